"""Kept for existing imports: the ``frozen_encoders=`` option lives in :mod:`st_ext.training.frozen_encoders`."""

from st_ext.training import frozen_encoders as _home
from st_ext.training.frozen_encoders import (  # noqa: F401
    FROZEN_ENCODER_MODES,
    apply_frozen_encoder_mode,
    frozen_encoder_losses,
    holders_and_their_datasets,
    require_resident,
    validate_frozen_encoder_mode,
)


def __getattr__(name: str):
    return getattr(_home, name)
