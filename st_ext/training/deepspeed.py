"""A Trainer's DeepSpeed set-up, checked when the trainer is built rather than found wrong after training.

st_ext's cached losses train under every ZeRO stage, holding the reduction until the last mini-batch
(:mod:`st_ext.gradient_sync`) through a parameter flag DeepSpeed reads from 0.17 on. What cannot work
is refused here, in one line that says what does:

* sentence-transformers' own cached losses, where st_ext's engine does not forward them
  (:mod:`st_ext.training.engine_forwards`: inside upstream's ``MatryoshkaLoss``, a subclass that overrides
  a step of upstream's engine, CrossEncoder's before sentence-transformers 6), return a loss without a
  ``grad_fn`` (DeepSpeed's ``engine.backward`` refuses it) and reduce once per mini-batch ("Gradient
  computed twice for this partition" from ZeRO stage 2);
* before DeepSpeed 0.17 nothing holds the reduction back, so only ZeRO stage 1 without
  ``overlap_comm`` (which reduces in ``step()``, not from hooks) trains a cached loss;
* at ZeRO stage 3 without ``stage3_gather_16bit_weights_on_model_save`` the weights are never gathered
  on save: sentence-transformers' save then fails on every rank but the first, after training.

``use_cpu=True`` with a DeepSpeed config makes accelerate train with DDP and ignore the config; that
stays upstream's behaviour, with a warning.
"""

from __future__ import annotations

import warnings
from typing import Any

from st_ext import losses
from st_ext._compat import (
    DEEPSPEED_HOLDS_REDUCTION,
    deepspeed_version,
    is_gradient_caching,
    training_deepspeed_config,
    upstream_loss_class,
)
from st_ext.losses.upstream_forwards import engine_forward
from st_ext.training.frozen_encoders import each_loss, loss_modules


def check_deepspeed_setup(args: Any, loss: Any) -> None:
    """Raise ``ValueError`` for a DeepSpeed configuration the trainer's loss (one, or a dict of them)
    cannot train or save under."""
    config = training_deepspeed_config(args)
    if config is None:
        return
    if getattr(args, "use_cpu", False):
        warnings.warn(
            "use_cpu=True with a DeepSpeed config: accelerate trains with DDP and ignores the config. Leave "
            "use_cpu unset to train with DeepSpeed (it finds the CPU itself where there is no accelerator).",
            stacklevel=3,
        )
        return
    stage = int(config.get_value("zero_optimization.stage", 0) or 0)
    cached = [module for module in loss_modules(loss) if is_gradient_caching(module)]
    on_engine = {id(module) for item in each_loss(loss) if engine_forward(item) for module in item.modules()}
    for module in cached:
        if id(module) not in on_engine and not _from_st_ext(module):
            name = type(module).__name__
            instead = (
                f"use st_ext.losses.{name}"
                if name in losses.ST_EXT_LOSSES and isinstance(module, upstream_loss_class(name) or ())
                else "st_ext's engine forwards it as the trainer's loss itself, from sentence-transformers 6 on "
                "for a CrossEncoder, without a subclass override of its engine's steps"
            )
            raise ValueError(
                f"sentence-transformers' {name} cannot train under DeepSpeed here (its loss has no grad_fn for "
                f"engine.backward, and from ZeRO stage 2 each mini-batch reduces again); {instead}."
            )
    if cached and stage >= 1:
        _require_reduction_hold(stage, bool(config.get_value("zero_optimization.overlap_comm", False)))
    if stage == 3 and not config.is_true("zero_optimization.stage3_gather_16bit_weights_on_model_save"):
        raise ValueError(
            "DeepSpeed ZeRO stage 3 without stage3_gather_16bit_weights_on_model_save: saving the model would fail "
            'after training. Set "stage3_gather_16bit_weights_on_model_save": true under "zero_optimization".'
        )


def _require_reduction_hold(stage: int, overlap_comm: bool) -> None:
    version = deepspeed_version()
    if version is None or version >= DEEPSPEED_HOLDS_REDUCTION or (stage == 1 and not overlap_comm):
        return
    setting = f"ZeRO stage {stage}" + (" with overlap_comm" if stage == 1 else "")
    raise ValueError(
        f"Cached losses under DeepSpeed {setting} need deepspeed>={DEEPSPEED_HOLDS_REDUCTION} (installed: "
        f"{version}); upgrade it, or use ZeRO stage 1 without overlap_comm, which works with {version}."
    )


def _from_st_ext(module: Any) -> bool:
    """Whether ``module`` is one of st_ext's losses (or of a subclass of one)."""
    own_classes = [getattr(losses, name) for name in losses.ST_EXT_LOSSES]
    return isinstance(module, tuple(cls for cls in own_classes if isinstance(cls, type)))
