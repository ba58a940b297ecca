"""The contract of the cached losses (``st_ext/losses/loss_functions.py``, the engine's ``LossStep``): wrappers are
functions of a loss's description and never name each other; the engine runs a loss's own description as its
forward does; a loss over embeddings gets the mini-batch size the auto mode resolved as an argument, and nothing is
written on a loss during a step; a cross-batch memory, which scores every step itself, refuses a subclass whose
scoring it would skip."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from loss_checks import features_of, loss_and_grads, text_columns

from st_ext import losses
from st_ext.losses.auto_mini_batch import AUTO, make_auto_mini_batch
from st_ext.losses.cross_batch_memory import CrossBatchMemoryLoss
from st_ext.losses.gradcache import CachedLoss, LossStep, gradcache_forward

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


def test_the_engine_runs_a_losss_description_as_its_own_forward_does(model):
    columns = text_columns(6, 2)
    inner = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
    loss = losses.MatryoshkaLoss(model, inner, [32, 16])
    expected = loss_and_grads(model, loss, columns, train=True)

    class ThroughTheEngine(torch.nn.Module):
        def forward(self, sentence_features, labels=None):
            return gradcache_forward(loss.cached_loss(), sentence_features, labels)

    actual = loss_and_grads(model, ThroughTheEngine(), columns, train=True)
    torch.testing.assert_close(actual, expected)


def test_a_loss_over_embeddings_gets_the_resolved_size_as_an_argument(model):
    """A description's ``start`` receives the size the auto mode chose for the batch; a loss scoring its
    rows a block at a time uses it, and the values are those of any block size."""
    features = features_of(model, text_columns(6, 2))
    sizes_read = []

    def start(sentence_features, ranges, mini_batch_size):
        sizes_read.append(mini_batch_size)

        def loss_fn(reps, labels, *, with_backward):
            anchors, positives = (torch.cat(column) for column in reps)
            total = 0
            for begin in range(0, len(anchors), mini_batch_size):
                value = (anchors[begin : begin + mini_batch_size] @ positives.T).logsumexp(dim=1).sum() / len(anchors)
                if with_backward:
                    value.backward()
                    value = value.detach()
                total = total + value
            return total

        return LossStep(lambda source: loss_fn)

    auto = make_auto_mini_batch(AUTO, None, 4096)
    value = gradcache_forward(CachedLoss("Blocks", model, start, AUTO, auto=auto), [dict(f) for f in features], None)
    value.backward()
    chosen = auto.choice.size
    assert sizes_read == [chosen] and isinstance(chosen, int)
    fixed = gradcache_forward(CachedLoss("Blocks", model, start, 1), [dict(f) for f in features], None)
    assert sizes_read == [chosen, 1]
    torch.testing.assert_close(fixed, value.detach())


class RecordingCachedMNRL(losses.CachedMultipleNegativesRankingLoss):
    """Records, per call of upstream's ``calculate_loss``, the size it reads, the columns it scores, and the
    size the user's loss holds meanwhile."""

    def calculate_loss(self, reps, *args, **kwargs):
        columns = [sum(len(rep) for rep in column) for column in reps]
        self.calls.append((self.mini_batch_size, columns, self.users_loss.mini_batch_size))
        return super().calculate_loss(reps, *args, **kwargs)


def recording_loss(model, **kwargs):
    loss = RecordingCachedMNRL(model, **kwargs)
    loss.calls = []
    loss.users_loss = loss
    return loss


def test_auto_reaches_upstreams_calculate_loss_without_writing_the_loss(model):
    loss = recording_loss(model, mini_batch_size=AUTO, memory_budget_mb=4096)
    loss_and_grads(model, loss, text_columns(6, 2), train=True)
    chosen = loss.auto_mini_batch.choice.size
    assert loss.calls == [(chosen, [6, 6], AUTO)] and loss.mini_batch_size == AUTO


@pytest.mark.parametrize("document_ids", [None, "label"])
def test_a_memory_refuses_a_subclass_whose_scoring_it_would_skip(model, document_ids):
    """A memory scores every step itself, so an override of upstream's scoring would never run: refused when the
    memory is built, in one line naming the class and the method; so is ``document_ids`` on such a subclass."""
    inner = recording_loss(model, mini_batch_size=2)
    with pytest.raises(TypeError, match=r"^CrossBatchMemoryLoss .*RecordingCachedMNRL's override of calculate_loss"):
        CrossBatchMemoryLoss(model, inner, memory_size=16, document_ids=document_ids)
    with pytest.raises(TypeError, match=r"RecordingCachedMNRL with document_ids .*override of calculate_loss"):
        RecordingCachedMNRL(model, mini_batch_size=2, document_ids="label")
