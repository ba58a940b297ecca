"""Kept for existing imports: the DDP work-arounds live in :mod:`st_ext.training.ddp`."""

from st_ext.training import ddp as _home
from st_ext.training.ddp import (  # noqa: F401
    CROSS_ENCODER_LOSS_ATTRIBUTES,
    expose_model_attributes,
    keep_cpu_flag,
    plain_dict_outputs,
    swap_model_in_loss,
)


def __getattr__(name: str):
    return getattr(_home, name)
