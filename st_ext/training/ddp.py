"""Work-arounds that let the upstream trainers run under DDP (``torchrun``) on every supported version.

Three upstream failures, each shown by ``tests/test_distributed.py``:

1. sentence-transformers 4.x builds default ``TrainingArguments`` inside the trainer's ``__init__``;
   their device set-up resets accelerate's process-wide state without the CPU flag, so a
   ``use_cpu=True`` run under torchrun trains each rank alone. :func:`keep_cpu_flag` holds the flag in
   ``ACCELERATE_USE_CPU`` while the trainer is built.
2. sentence-transformers 4.x's ``override_model_in_loss`` only swaps ``SentenceTransformer`` children,
   so a CrossEncoder loss keeps calling the unwrapped model and DDP never averages its gradients.
   :func:`swap_model_in_loss` swaps any child that is the trainer's model, and gives the DDP wrapper
   what CrossEncoder losses read from the model.
3. A CrossEncoder's forward returns the tokenizer's ``BatchEncoding`` (a ``UserDict``), in which DDP
   finds no output tensors; with ``find_unused_parameters=True`` every parameter is then marked ready
   twice. :func:`plain_dict_outputs` returns such outputs as plain dicts while training.
"""

from __future__ import annotations

import contextlib
import os
from collections import UserDict
from collections.abc import Iterator

from torch import nn

from st_ext._compat import own_submodules
from st_ext.scoped_entries import entries_set

# What CrossEncoder losses read from ``self.model`` besides calling it.
CROSS_ENCODER_LOSS_ATTRIBUTES = ("tokenizer", "device", "num_labels", "preprocess", "get_embedding_dimension")


def keep_cpu_flag(args) -> contextlib.AbstractContextManager[None]:
    """Set ``ACCELERATE_USE_CPU`` while the block runs when ``args.use_cpu`` asks for the CPU."""
    if not getattr(args, "use_cpu", False):
        return contextlib.nullcontext()
    return entries_set(os.environ, {"ACCELERATE_USE_CPU": "true"})


def swap_model_in_loss(loss: nn.Module, wrapped: nn.Module) -> None:
    """Point every ``.model`` in ``loss`` that is the model inside ``wrapped`` (DDP) at ``wrapped``, and copy
    onto ``wrapped`` the attributes CrossEncoder losses read from the model, where it lacks them."""
    model = getattr(wrapped, "module", None)
    if not isinstance(model, nn.Module):
        return
    for module in list(loss.modules()):
        if own_submodules(module).get("model") is model:
            module.model = wrapped
    for name in CROSS_ENCODER_LOSS_ATTRIBUTES:
        if hasattr(model, name) and not hasattr(wrapped, name):
            setattr(wrapped, name, getattr(model, name))


@contextlib.contextmanager
def plain_dict_outputs(model: nn.Module | None) -> Iterator[None]:
    """Return ``UserDict`` outputs of ``model`` as plain dicts (DDP searches dicts for tensors)."""
    if model is None:
        yield
        return

    def to_dict(module, inputs, output):
        return dict(output) if isinstance(output, UserDict) else None

    handle = model.register_forward_hook(to_dict)
    try:
        yield
    finally:
        handle.remove()
