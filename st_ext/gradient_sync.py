"""Holding the cross-rank gradient reduction of a cached step until its last mini-batch.

A cached loss back-propagates once per mini-batch, and every engine reduces from hooks that fire on each
backward: DDP all-reduces every time (correct, and wasteful), FSDP2 reduce-scatters every time, and DeepSpeed
ZeRO stages 2 and 3 refuse a parameter's second reduction within a step ("Gradient computed twice for this
partition"). Each engine has its own switch meaning "accumulate locally, reduce later"; this module is the one
place that knows them.

Two DDP settings change what holding means:

* ``static_graph=True``: DDP learns the graph in its first iteration and needs that iteration's first backward
  to reduce, even inside an outer ``no_sync``; otherwise it fails an internal assertion
  (``expect_autograd_hooks_``) at the end of the first held backward.
* ``find_unused_parameters=True`` on torch before 2.4: DDP's unused-parameter search ignored what a backward
  inside ``no_sync`` used (pytorch PR #124193), so a parameter used by a held mini-batch and not by the last
  was never reduced and the ranks' weights parted. There every mini-batch reduces: slower, and correct, since
  each reduction averages gradients the ranks already agree on plus the mini-batch's own.

A model compiled with ``torch.compile`` (accelerate compiles the DDP or FSDP2 module itself) is looked
through: its ``_orig_mod`` is the engine's module.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, cast

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from st_ext import _compat
from st_ext._compat import compiled_module, is_fsdp2_module

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


def gradient_sync(model: nn.Module, sync: bool) -> AbstractContextManager[None]:
    """Backward passes inside this context reduce gradients across ranks only if ``sync``.

    With ``sync=False`` gradients accumulate on the rank; the first backward with ``sync=True``
    reduces everything accumulated so far, so a step reduces once whatever its mini-batch count (DDP's
    exceptions, static graphs and torch < 2.4, are in the module docstring).
    """
    model = compiled_module(model)
    if isinstance(model, DistributedDataParallel):
        if _compat.ddp_static_graph_first_iteration(model):
            return _compat.ddp_reduces_in_backward(model)  # even inside an outer no_sync
        if sync or (model.find_unused_parameters and not _compat.DDP_NO_SYNC_TRACKS_UNUSED_PARAMETERS):
            return nullcontext()
        return model.no_sync()
    if is_fsdp2_module(model):
        return _fsdp2_gradient_sync(model, sync)
    # DeepSpeed can be reducing this process's gradients only where it is imported and a process group is set up
    # (``deepspeed.initialize`` sets one up, for one rank too). A process that only imported it (transformers does
    # when it saves a model, wherever DeepSpeed is installed) has nothing to hold, and marks no parameter.
    if "deepspeed" in sys.modules and dist.is_available() and dist.is_initialized():
        return _deepspeed_gradient_sync(model, sync)
    return nullcontext()


def without_forward_collectives(model: nn.Module) -> AbstractContextManager[None]:
    """A forward pass that only this rank runs: DDP skips its buffer broadcast before it (a collective the
    other ranks would not join)."""
    model = compiled_module(model)
    if not isinstance(model, DistributedDataParallel):
        return nullcontext()
    return _compat.ddp_skips_forward_buffer_broadcast(model)


def parameters_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are split across ranks (FSDP2, DeepSpeed ZeRO-3): every forward
    pass then gathers them, a collective that all ranks must enter together."""
    return sharded_by_fsdp2(model) or zero3_partitioned(model)


def sharded_by_fsdp2(model: nn.Module) -> bool:
    """Whether ``fully_shard`` sharded ``model`` or any of its submodules."""
    return any(is_fsdp2_module(module) for module in model.modules())


def zero3_partitioned(module: nn.Module) -> bool:
    """Whether ``deepspeed.zero.Init`` split ``module``'s parameters across ranks while it was built."""
    return any(_compat.partitioned_by_deepspeed(param) for param in module.parameters())


@contextmanager
def _fsdp2_gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Besides holding the reduction: a module that stays gathered after forward (``reshard_after_forward=False``,
    by FSDP2's default the root module) keeps its parameters gathered after a held backward too, so the step
    gathers it once instead of once per mini-batch; its peak is unchanged, since each forward leaves it gathered."""
    kept_gathered = (
        []
        if sync
        else [
            cast("FSDPModule", module)
            for module in model.modules()
            if _compat.fsdp2_resharded_after_backward_only(module)
        ]
    )
    sharded_model = cast("FSDPModule", model)
    sharded_model.set_requires_gradient_sync(sync)
    for module in kept_gathered:
        module.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        sharded_model.set_requires_gradient_sync(True)
        for module in kept_gathered:
            module.set_reshard_after_backward(True, recurse=False)


def _deepspeed_gradient_sync(model: nn.Module, sync: bool) -> AbstractContextManager[None]:
    """ZeRO's hooks queue a gradient for reduction only while its parameter is marked ready."""
    return _compat.deepspeed_gradients_ready(
        [param for param in model.parameters() if param.requires_grad], ready=sync
    )
