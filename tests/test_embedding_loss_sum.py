"""EmbeddingLossSum: a cached loss plus losses over the same embeddings, in one GradCache pass.

Each test compares with the uncached sum written out by hand (upstream's InfoNCE + GOR recipe: embed each column
once, sum the losses over the embeddings), value of every term and every gradient, cached in several mini-batches
and in one pass; then the compositions (Matryoshka around the sum, a cross-batch memory inside it, a layer-wise
loss around it), the trainer's per-term log, and the refusals.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from loss_checks import assert_bounded_by_the_mini_batch, features_of, text_columns

from st_ext import losses
from st_ext._compat import trainer_sums_loss_terms

pytestmark = pytest.mark.skipif(not trainer_sums_loss_terms(), reason="4.x's trainer takes no loss of named terms")

BATCH = 6
GOR_WEIGHT = 0.5


def upstream_gor(model):
    return losses.GlobalOrthogonalRegularizationLoss(model, second_moment_weight=1.0, aggregation="sum")


def summed(model, mini_batch_size: int):
    inner = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size)
    return losses.EmbeddingLossSum(inner, {"gor": upstream_gor(model)}, {"gor": GOR_WEIGHT}, name="info_nce")


def reference_terms(model, columns, dims=(None,)) -> dict[str, torch.Tensor]:
    """The uncached sum, by hand: every column embedded once, MNRL and GOR over the (truncated) embeddings."""
    mnrl, gor = losses.MultipleNegativesRankingLoss(model), upstream_gor(model)
    embeddings = [model(features)["sentence_embedding"] for features in features_of(model, columns)]
    terms = {"info_nce": torch.zeros(()), "gor": torch.zeros(())}
    for dim in dims:
        shrunk = embeddings if dim is None else [F.normalize(e[:, :dim], p=2, dim=-1) for e in embeddings]
        terms["info_nce"] = terms["info_nce"] + mnrl.compute_loss_from_embeddings(shrunk, None)
        gor_terms = gor.compute_loss_from_embeddings(shrunk, None)
        terms["gor"] = terms["gor"] + GOR_WEIGHT * sum(gor_terms.values())
    return terms


def terms_and_grads(model, terms_of):
    model.zero_grad(set_to_none=True)
    model.eval()
    terms = terms_of()
    sum(terms.values()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {key: value.detach() for key, value in terms.items()}, grads


def assert_same(actual, expected) -> None:
    (actual_terms, actual_grads), (expected_terms, expected_grads) = actual, expected
    assert list(actual_terms) == list(expected_terms)
    for key, value in expected_terms.items():
        torch.testing.assert_close(actual_terms[key], value, rtol=1e-4, atol=1e-6, msg=key)
    assert actual_grads.keys() == expected_grads.keys()
    scale = max(grad.abs().max().item() for grad in expected_grads.values())
    for name, grad in expected_grads.items():
        torch.testing.assert_close(actual_grads[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("mini_batch_size", [2, 4, 64], ids=["3-passes", "uneven", "one-pass"])
def test_the_sum_equals_the_uncached_sum(model, mini_batch_size):
    columns = text_columns(BATCH, 2, seed=1)
    loss = summed(model, mini_batch_size)
    expected = terms_and_grads(model, lambda: reference_terms(model, columns))
    assert_same(terms_and_grads(model, lambda: loss(features_of(model, columns), None)), expected)


def test_every_matryoshka_dimension_trains_on_the_sum(model):
    columns = text_columns(BATCH, 3, seed=2)  # a hard-negative column too
    dims = [32, 16, 8]
    loss = losses.MatryoshkaLoss(model, summed(model, 4), dims)
    expected = terms_and_grads(model, lambda: reference_terms(model, columns, dims))
    assert_same(terms_and_grads(model, lambda: loss(features_of(model, columns), None)), expected)


def test_the_added_losses_see_the_batch_not_a_memorys_queue(model):
    memory = losses.CrossBatchMemoryLoss(
        model, losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2), memory_size=12
    )
    loss = losses.EmbeddingLossSum(memory, {"gor": upstream_gor(model)}, {"gor": GOR_WEIGHT}, name="info_nce")
    alone = losses.CrossBatchMemoryLoss(
        model, losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2), memory_size=12
    )
    gor = upstream_gor(model)
    model.eval()
    for step in range(2):  # the second step scores a queue of the first step's rows
        columns = text_columns(BATCH, 2, seed=10 + step)
        terms = loss(features_of(model, columns), None)
        expected_memory = alone(features_of(model, columns), None)
        with torch.no_grad():
            embeddings = [model(features)["sentence_embedding"] for features in features_of(model, columns)]
            expected_gor = GOR_WEIGHT * sum(gor.compute_loss_from_embeddings(embeddings, None).values())
        torch.testing.assert_close(terms["info_nce"].detach(), expected_memory.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(terms["gor"].detach(), expected_gor, rtol=1e-5, atol=1e-6)
        sum(terms.values()).backward()
        expected_memory.backward()
        model.zero_grad(set_to_none=True)


def test_a_layerwise_loss_around_the_sum_trains_it_cached_as_in_one_pass(model):
    columns = text_columns(BATCH, 2, seed=3)

    def layerwise(mini_batch_size):
        return losses.AdaptiveLayerLoss(model, summed(model, mini_batch_size), n_layers_per_step=-1)

    expected = terms_and_grads(model, lambda: layerwise(64)(features_of(model, columns), None))
    actual = terms_and_grads(model, lambda: layerwise(2)(features_of(model, columns), None))
    assert_same(actual, expected)
    assert expected[0]["gor"] > 0  # the added loss is there, at every layer


def test_the_trainer_logs_each_term(model, tmp_path):
    from datasets import Dataset

    from st_ext import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    anchors, positives = text_columns(8, 2, seed=4)
    dataset = Dataset.from_dict({"anchor": anchors, "positive": positives})
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True,
    )  # fmt: skip
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=summed(model, 2))
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry and "info_nce" in entry]
    assert len(logged) == 2, trainer.state.log_history
    for entry in logged:
        assert entry["loss"] == pytest.approx(entry["info_nce"] + entry["gor"], rel=1e-3, abs=1e-4)


def test_backward_on_one_term_alone_is_refused(model):
    columns = text_columns(BATCH, 2, seed=5)
    terms = summed(model, 2)(features_of(model, columns), None)
    with pytest.raises(ValueError, match="call backward\\(\\) on their sum"):
        terms["gor"].backward()


def test_what_cannot_be_summed_is_refused_when_built(model, guide):
    cached = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
    gor = upstream_gor(model)
    cases = [
        (lambda: losses.EmbeddingLossSum(losses.MultipleNegativesRankingLoss(model), {"gor": gor}), "not a cached"),
        (lambda: losses.EmbeddingLossSum(cached, {"gor": torch.nn.Linear(2, 2)}), "no compute_loss_from_embeddings"),
        (lambda: losses.EmbeddingLossSum(cached, {"gor": upstream_gor(guide)}), "another model"),
        (lambda: losses.EmbeddingLossSum(cached, {"gor": gor}, {"gro": 1.0}), "weights name losses"),
        (lambda: losses.EmbeddingLossSum(cached, {"gor": gor}, {"gor": "high"}), "must be a number"),
        (lambda: losses.EmbeddingLossSum(cached, {}), "extra_losses is empty"),
        (lambda: losses.EmbeddingLossSum(cached, {"loss": gor}), 'other than "loss"'),
        (lambda: losses.EmbeddingLossSum(cached, {"gor": gor}, name="loss"), 'other than "loss"'),
        (lambda: losses.EmbeddingLossSum(cached, {"gor": gor}, name="gor"), "names both"),
        (lambda: losses.EmbeddingLossSum(losses.EmbeddingLossSum(cached, {"gor": gor}), {"g": gor}), "already sums"),
    ]
    for build, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            build()
        assert "\n" not in str(error.value)
    with pytest.raises(TypeError, match="cannot be wrapped"):
        losses.EmbeddingLossSum(losses.AdaptiveLayerLoss(model, cached), {"gor": gor})


def test_the_readmes_embeddinggemma_recipe_runs(tmp_path):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("### Losses over the same embeddings", 1)[1]
    snippet = section.split("```py\n", 1)[1].split("```", 1)[0]
    run = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "'info_nce'" in run.stdout and "'gor'" in run.stdout, run.stdout[-2000:]


class UncachedSum(torch.nn.Module):
    """Upstream's recipe: embed every column once, sum MNRL and GOR over the embeddings."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model, self.mnrl, self.gor = model, losses.MultipleNegativesRankingLoss(model), upstream_gor(model)

    def forward(self, sentence_features, labels=None):
        embeddings = [self.model(features)["sentence_embedding"] for features in sentence_features]
        gor = self.gor.compute_loss_from_embeddings(embeddings, labels)
        return self.mnrl.compute_loss_from_embeddings(embeddings, labels) + GOR_WEIGHT * sum(gor.values())


def test_memory_stays_bounded_by_the_mini_batch(model):
    loss = summed(model, 16)

    def cached(features, labels):
        return sum(loss(features, labels).values())

    assert_bounded_by_the_mini_batch(model, cached, UncachedSum(model))
