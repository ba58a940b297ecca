"""Holding the cross-rank gradient reduction of a cached step until its last mini-batch.

A cached loss back-propagates once per mini-batch. Every engine that shards or replicates a model
across ranks reduces gradients from hooks that fire on each backward, so left alone it would reduce
once per mini-batch: DDP all-reduces every time (correct, and wasteful), FSDP2 reduce-scatters every
time, and DeepSpeed ZeRO stages 2 and 3 refuse a parameter's second reduction within a step
("Gradient computed twice for this partition"). Each engine has its own switch meaning "accumulate
locally, reduce later"; this module is the one place that knows them.

Two DDP settings change what holding means:

* ``static_graph=True``: DDP learns the graph in its first iteration and needs that iteration's first
  backward to reduce. Until it has (``_static_graph_delay_allreduce_enqueued``), a mini-batch reduces,
  even inside an outer ``no_sync``; without this, DDP fails an internal assertion
  (``expect_autograd_hooks_``) at the end of the first held backward.
* ``find_unused_parameters=True`` on torch before 2.4: DDP's unused-parameter search ignored what a
  backward inside ``no_sync`` used (pytorch PR #124193), so a parameter used by a held mini-batch and
  not by the last one was never reduced and the ranks' weights parted. There every mini-batch reduces:
  slower, and correct, since each reduction averages gradients the ranks already agree on plus the
  mini-batch's own.

A model compiled with ``torch.compile`` (accelerate compiles the DDP or FSDP2 module itself) is looked
through: its ``_orig_mod`` is the engine's module.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from st_ext import _compat
from st_ext._compat import compiled_module, fsdp2_module_class

#: The parameter attribute DeepSpeed ZeRO (0.17 and later) reads before queueing a gradient for
#: reduction: while it is False the gradient accumulates in ``.grad`` and is not reduced.
DEEPSPEED_READY_FLAG = "ds_grad_is_ready"


def gradient_sync(model: nn.Module, sync: bool) -> AbstractContextManager[None]:
    """Backward passes inside this context reduce gradients across ranks only if ``sync``.

    With ``sync=False`` gradients accumulate on the rank; the first backward with ``sync=True``
    reduces everything accumulated so far, so a step reduces once whatever its mini-batch count
    (DDP's exceptions, static graphs and torch < 2.4, are in the module docstring).
    """
    model = compiled_module(model)
    if isinstance(model, DistributedDataParallel):
        return _ddp_gradient_sync(model, sync)
    fsdp_module = fsdp2_module_class()
    if fsdp_module is not None and isinstance(model, fsdp_module):
        return _fsdp2_gradient_sync(model, sync)
    if deepspeed_in_use():
        return _deepspeed_gradient_sync(model, sync)
    return nullcontext()


def _ddp_gradient_sync(model: DistributedDataParallel, sync: bool) -> AbstractContextManager[None]:
    if _compat.ddp_static_graph_first_iteration(model):
        return _ddp_forced_sync(model)
    if sync or (model.find_unused_parameters and not _compat.DDP_NO_SYNC_TRACKS_UNUSED_PARAMETERS):
        return nullcontext()
    return model.no_sync()


@contextmanager
def _ddp_forced_sync(model: DistributedDataParallel) -> Iterator[None]:
    """Reduce in this backward even inside an outer ``no_sync``: static-graph DDP's first iteration."""
    before = model.require_backward_grad_sync
    model.require_backward_grad_sync = True
    try:
        yield
    finally:
        model.require_backward_grad_sync = before


@contextmanager
def without_forward_collectives(model: nn.Module) -> Iterator[None]:
    """A forward pass that only this rank runs: DDP skips its buffer broadcast before it (a collective the
    other ranks would not join)."""
    model = compiled_module(model)
    if not isinstance(model, DistributedDataParallel):
        yield
        return
    before = model.require_forward_param_sync
    model.require_forward_param_sync = False
    try:
        yield
    finally:
        model.require_forward_param_sync = before


def parameters_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are split across ranks (FSDP2, DeepSpeed ZeRO-3): every forward
    pass then gathers them, a collective that all ranks must enter together."""
    return sharded_by_fsdp2(model) or zero3_partitioned(model)


def sharded_by_fsdp2(model: nn.Module) -> bool:
    """Whether ``fully_shard`` sharded ``model`` or any of its submodules."""
    fsdp_module = fsdp2_module_class()
    return fsdp_module is not None and any(isinstance(module, fsdp_module) for module in model.modules())


def zero3_partitioned(module: nn.Module) -> bool:
    """Whether ``deepspeed.zero.Init`` split ``module``'s parameters across ranks while it was built."""
    return any(hasattr(param, "ds_id") for param in module.parameters())


def deepspeed_in_use() -> bool:
    """DeepSpeed is imported only by a process that trains with it (the Trainer imports it lazily)."""
    return "deepspeed" in sys.modules


@contextmanager
def _fsdp2_gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Besides holding the reduction: a module that stays gathered after forward (sharded with
    ``reshard_after_forward=False``, FSDP's SHARD_GRAD_OP; by FSDP2's default, the root module) keeps its
    gathered parameters after a held backward too, so the step gathers it once instead of once per
    mini-batch pass; its peak is unchanged, since each forward leaves it gathered anyway. A module that
    reshards after forward is left alone."""
    kept_gathered = [] if sync else [module for module in model.modules() if _stays_gathered_after_forward(module)]
    model.set_requires_gradient_sync(sync)
    for module in kept_gathered:
        module.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        for module in kept_gathered:
            module.set_reshard_after_backward(True, recurse=False)


def _stays_gathered_after_forward(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 module that keeps its parameters gathered after forward
    (``reshard_after_forward=False``) and reshards them after backward (FSDP2's default there). FSDP2
    has setters for both, no getters, so this reads its parameter group; where a torch release does not
    have it, the answer is False and the module reshards after every backward, as FSDP2 does."""
    fsdp_module = fsdp2_module_class()
    if fsdp_module is None or not isinstance(module, fsdp_module):
        return False
    group = _compat.fsdp2_parameter_group(module)
    if group is None or not hasattr(group, "post_forward_mesh_info"):
        return False
    return group.post_forward_mesh_info is None and getattr(group, "reshard_after_backward", False)


@contextmanager
def _deepspeed_gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """ZeRO's hooks queue a gradient for reduction only while the parameter's flag is True (or unset);
    the flags are put back as they were, absent where they were absent."""
    params = [p for p in model.parameters() if p.requires_grad]
    missing = object()
    before = [getattr(p, DEEPSPEED_READY_FLAG, missing) for p in params]
    for param in params:
        setattr(param, DEEPSPEED_READY_FLAG, sync)
    try:
        yield
    finally:
        for param, value in zip(params, before):
            if value is missing:
                delattr(param, DEEPSPEED_READY_FLAG)
            else:
                setattr(param, DEEPSPEED_READY_FLAG, value)
