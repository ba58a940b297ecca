"""transformers' checkpointing options with a cached loss: each gives the uncached loss's gradients.

A cached loss replays every mini-batch's forward pass under checkpointing, inside its backward. The
options: ``use_reentrant`` on or off (a ``torch.utils.checkpoint`` argument, every release), and
transformers 5's ``every_n_layers`` (checkpoint every n-th layer only) and ``offload`` (the saved
activations in host memory), which a Trainer takes in ``gradient_checkpointing_kwargs``. The memory each
saves: ``docs/checkpointing.md``.
"""

from __future__ import annotations

import pytest
import torch
from archetype_losses import texts
from tiny_models import save_tiny_bert, sentence_transformer_from

from st_ext import _compat, losses
from st_ext._compat import preprocess

#: (torch.utils.checkpoint arguments, transformers' own options) per case.
OPTIONS = {
    "non-reentrant": ({"use_reentrant": False}, {}),
    "reentrant": ({"use_reentrant": True}, {}),
    "every-2nd-layer": (None, {"every_n_layers": 2}),
    "offload": (None, {"offload": True}),
    "every-2nd-layer-offloaded": (None, {"every_n_layers": 2, "offload": True}),
}


#: transformers' offload holds the saved activations in pinned host memory, which torch cannot allocate
#: without an accelerator: there it fails alike for the uncached loss ("pin_memory=True requires a CUDA or other
#: accelerator backend"), and a CPU-only machine has no device memory to offload from.
PINNED_MEMORY = torch.cuda.is_available() or torch.accelerator.current_accelerator() is not None


def option(name: str):
    extra = OPTIONS[name][1]
    missing = sorted(set(extra) - _compat.HF_CHECKPOINTING_OPTIONS)
    marks = [
        pytest.mark.skipif(
            bool(missing),
            reason=f"transformers {_compat.TRANSFORMERS_VERSION} has no checkpointing option {', '.join(missing)}",
        )
    ]
    if extra.get("offload"):
        marks.append(pytest.mark.skipif(not PINNED_MEMORY, reason="offload pins host memory: needs an accelerator"))
    return pytest.param(name, id=name, marks=marks)


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    """Six layers, dropout 0: the cached and the plain step see the same function."""
    return save_tiny_bert(tmp_path_factory.mktemp("options_bert"), num_layers=6, hidden_size=64, dropout=0.0)


def step_grads(model, loss) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad(set_to_none=True)
    columns = [texts(6, seed=1), texts(6, seed=2)]
    loss([preprocess(model, column) for column in columns], None).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", [option(name) for name in OPTIONS])
def test_cached_loss_under_each_checkpointing_option_gives_the_uncached_gradients(name, deep_dir):
    plain = sentence_transformer_from(deep_dir)
    expected = step_grads(plain, losses.MultipleNegativesRankingLoss(plain))
    model = sentence_transformer_from(deep_dir)
    checkpoint_kwargs, extra = OPTIONS[name]
    model.gradient_checkpointing_enable(checkpoint_kwargs, **extra)
    if extra.get("every_n_layers") == 2:
        flags = [
            getattr(m, "gradient_checkpointing", None) for m in model.modules() if type(m).__name__ == "BertLayer"
        ]
        assert flags == [True, False] * 3
    else:  # transformers 4 flags the encoder, 5 each layer
        assert any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
    grads = step_grads(model, losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2))
    assert grads.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(grads[key], value, rtol=1e-4, atol=1e-6, msg=key)
