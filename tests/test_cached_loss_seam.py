"""The seam of the cached losses (``st_ext/losses/cached_loss.py``): wrappers are functions of a loss's
description and never name each other; the engine runs a description, a registered loss or the older
protocol alike, and a loss over embeddings reads the mini-batch size the auto mode resolved."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from loss_checks import features_of, loss_and_grads, text_columns

from st_ext import losses
from st_ext.losses.auto_mini_batch import AUTO, make_auto_mini_batch
from st_ext.losses.cached_loss import as_cached_loss
from st_ext.losses.gradcache import gradcache_forward

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOSSES_DIR = Path(__file__).resolve().parents[1] / "st_ext" / "losses"
#: The modules of the wrappers, each a function from one cached-loss description to another.
WRAPPER_MODULES = {"matryoshka", "cross_batch_memory", "adaptive_layer"}


def imported_st_ext_losses_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("st_ext.losses."):
            modules.add(node.module.rsplit(".", 1)[1])
        elif isinstance(node, ast.Import):
            modules.update(
                alias.name.rsplit(".", 1)[1] for alias in node.names if alias.name.startswith("st_ext.losses.")
            )
    return modules


@pytest.mark.parametrize("wrapper", sorted(WRAPPER_MODULES))
def test_no_wrapper_imports_another(wrapper):
    others = imported_st_ext_losses_modules(LOSSES_DIR / f"{wrapper}.py") & (WRAPPER_MODULES - {wrapper})
    assert not others, f"{wrapper}.py imports the wrapper(s) {sorted(others)}: compose through as_cached_loss instead"


@pytest.fixture
def model(tiny_bert_dir):
    from tiny_models import sentence_transformer_from

    return sentence_transformer_from(tiny_bert_dir)


def test_the_engine_runs_a_registered_loss_as_its_own_forward_does(model):
    columns = text_columns(6, 2)
    inner = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
    loss = losses.MatryoshkaLoss(model, inner, [32, 16])
    expected = loss_and_grads(model, loss, columns, train=True)

    class ThroughTheEngine(torch.nn.Module):
        def forward(self, sentence_features, labels=None):
            return gradcache_forward(loss, sentence_features, labels)

    actual = loss_and_grads(model, ThroughTheEngine(), columns, train=True)
    torch.testing.assert_close(actual, expected)


class ProtocolLoss:
    """A loss with the older protocol that scores its rows ``self.mini_batch_size`` at a time."""

    def __init__(self, model, mini_batch_size, budget_mb=None):
        self.model = model
        self.mini_batch_size = mini_batch_size
        self.mini_batch_num_tokens = None
        self.show_progress_bar = False
        self.auto_mini_batch = make_auto_mini_batch(mini_batch_size, None, budget_mb)
        self.sizes_read = []

    def frozen_embeddings(self, sentence_features, ranges):
        return None

    def loss_from_embeddings(self, reps, frozen, labels, *, with_backward):
        self.sizes_read.append(self.mini_batch_size)
        anchors, positives = (torch.cat(column) for column in reps)
        total = 0
        for begin in range(0, len(anchors), self.mini_batch_size):
            block = anchors[begin : begin + self.mini_batch_size] @ positives.T
            value = block.logsumexp(dim=1).sum() / len(anchors)
            if with_backward:
                value.backward()
                value = value.detach()
            total = total + value
        return total


def test_a_protocol_loss_with_auto_reads_the_resolved_size(model):
    features = features_of(model, text_columns(6, 2))
    loss = ProtocolLoss(model, AUTO, budget_mb=4096)
    gradcache_forward(loss, [dict(f) for f in features], None).backward()
    chosen = loss.auto_mini_batch.choice.size
    assert loss.sizes_read == [chosen] and isinstance(chosen, int)
    assert loss.mini_batch_size == AUTO
    fixed = ProtocolLoss(model, chosen)
    assert as_cached_loss(fixed) is None  # not registered: the engine describes it by the protocol
    model.zero_grad(set_to_none=True)
    value = gradcache_forward(fixed, [dict(f) for f in features], None)
    assert fixed.sizes_read == [chosen] and torch.isfinite(value)
