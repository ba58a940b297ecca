"""st_ext's batch-all / batch-hard / semi-hard triplet losses against upstream's, and with a memory
against the plain loss over batch + memory spelled out densely (a B×R×R cube is fine at test sizes)."""

from __future__ import annotations

import pytest
import torch
from loss_checks import assert_same_grads, features_of, random_texts
from tiny_models import sentence_transformer_from

from st_ext._compat import st_losses
from st_ext.losses import triplet
from st_ext.memory import measure_peak

upstream = st_losses()
UPSTREAM_METRICS = upstream.BatchHardTripletLossDistanceFunction
LOSS_NAMES = ["BatchAllTripletLoss", "BatchHardTripletLoss", "BatchSemiHardTripletLoss"]
METRICS = {
    "euclidean": (triplet.euclidean_distance, UPSTREAM_METRICS.eucledian_distance),
    "cosine": (triplet.cosine_distance, UPSTREAM_METRICS.cosine_distance),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tiny_bert_dir):
    return sentence_transformer_from(tiny_bert_dir)


def loss_and_grads_with_labels(model, loss, texts, labels, seed: int = 1):
    """Value and every parameter's gradient after one forward and backward (dropout on, fixed RNG)."""
    model.zero_grad(set_to_none=True)
    model.train()
    features = features_of(model, [texts])
    torch.manual_seed(seed)
    value = loss(features, labels)
    value.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return value.detach(), grads


@pytest.mark.parametrize("loss_name", LOSS_NAMES)
@pytest.mark.parametrize("metric", list(METRICS))
def test_equals_upstream_on_a_model(model, loss_name, metric, seed=0):
    ours_metric, upstream_metric = METRICS[metric]
    generator = torch.Generator().manual_seed(seed)
    texts = random_texts(16, seed=seed)
    labels = torch.randint(0, 4, (16,), generator=generator)
    margin = 0.5 if metric == "cosine" else 5
    reference = getattr(upstream, loss_name)(model, distance_metric=upstream_metric, margin=margin)
    for metric_function in (ours_metric, upstream_metric):
        ours = getattr(triplet, loss_name)(model, distance_metric=metric_function, margin=margin)
        assert_same_grads(
            loss_and_grads_with_labels(model, ours, texts, labels, seed),
            loss_and_grads_with_labels(model, reference, texts, labels, seed),
        )


class Rows(torch.nn.Module):
    """A "model" that returns the rows it is given: tests on raw embeddings go through forward()."""

    def forward(self, features):
        return {"sentence_embedding": features["rows"]}


@pytest.mark.parametrize("loss_name", LOSS_NAMES)
@pytest.mark.parametrize("metric", list(METRICS))
@pytest.mark.parametrize("margin", [0.05, 0.4, 5.0])
def test_equals_upstream_on_random_embeddings(loss_name, metric, margin):
    """Many label patterns, including classes of one and batches of one class, at several margins."""
    ours_metric, upstream_metric = METRICS[metric]
    generator = torch.Generator().manual_seed(7)
    for trial in range(12):
        batch = int(torch.randint(2, 40, (), generator=generator))
        rows = torch.randn(batch, 6, generator=generator) * (0.3 if trial % 2 else 1.0)
        labels = torch.randint(0, max(1, batch // (1 + trial % 4)), (batch,), generator=generator)
        results = []
        for loss in (
            getattr(triplet, loss_name)(Rows(), distance_metric=ours_metric, margin=margin),
            getattr(upstream, loss_name)(Rows(), distance_metric=upstream_metric, margin=margin),
        ):
            leaf = rows.clone().requires_grad_()
            value = loss([{"rows": leaf}], labels)
            value.backward()
            results.append((value.detach(), leaf.grad))
        (value, grad), (expected_value, expected_grad) = results
        torch.testing.assert_close(value, expected_value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# With a memory: the plain loss over batch + memory, anchors from the batch, spelled out densely


def dense_distances(metric, rows, memory):
    """Upstream's batch metric over the concatenated rows, cut to the batch's anchors."""
    return metric(torch.cat([rows, memory.detach()]))[: len(rows)]


def dense_masks(labels, ref_labels):
    same = labels[:, None] == ref_labels[None]
    not_self = torch.arange(len(ref_labels))[None] != torch.arange(len(labels))[:, None]
    return same, same & not_self


def dense_batch_all(distances, labels, ref_labels, margin):
    same, positive = dense_masks(labels, ref_labels)
    valid = positive[:, :, None] & ~same[:, None, :]
    terms = (distances[:, :, None] - distances[:, None, :] + margin) * valid
    terms = terms.masked_fill(terms < 0, 0)
    return terms.sum() / ((terms > 1e-16).sum() + 1e-16)


def dense_batch_hard(distances, labels, ref_labels, margin):
    same, positive = dense_masks(labels, ref_labels)
    hardest_positive = torch.where(positive, distances, torch.zeros_like(distances)).max(1).values
    shifted = distances + distances.max(1, keepdim=True).values * same
    hardest_negative = shifted.min(1).values
    return (hardest_positive - hardest_negative + margin).clamp_min(0).mean()


def dense_semi_hard(distances, labels, ref_labels, margin):
    """Per positive pair, by brute force over all references: nearest negative farther than it."""
    same, positive = dense_masks(labels, ref_labels)
    farther = ~same[:, None, :] & (distances[:, None, :] > distances[:, :, None])  # [a, p, n]
    nearest_farther = torch.where(farther, distances[:, None, :], torch.inf).min(2).values
    negatives = torch.where(~same, distances, -torch.inf)
    farthest = torch.where((~same).any(1), negatives.max(1).values, distances.min(1).values)[:, None]
    semi_hard = torch.where(farther.any(2), nearest_farther, farthest)
    losses = (distances - semi_hard + margin).clamp_min(0) * positive
    return losses.sum() / positive.sum().clamp(min=1)


DENSE = {
    "BatchAllTripletLoss": dense_batch_all,
    "BatchHardTripletLoss": dense_batch_hard,
    "BatchSemiHardTripletLoss": dense_semi_hard,
}


@pytest.mark.parametrize("loss_name", LOSS_NAMES)
@pytest.mark.parametrize("metric", list(METRICS))
def test_memory_version_equals_the_loss_over_batch_and_memory(loss_name, metric):
    ours_metric, upstream_metric = METRICS[metric]
    margin = 0.3 if metric == "cosine" else 1.5
    generator = torch.Generator().manual_seed(3)
    for trial in range(6):
        batch, memory_rows = 8 + trial, 5 + 7 * trial
        rows = torch.randn(batch, 6, generator=generator)
        memory = torch.randn(memory_rows, 6, generator=generator)
        labels = torch.randint(0, 5, (batch,), generator=generator)
        memory_labels = torch.randint(0, 5, (memory_rows,), generator=generator)

        leaf = rows.clone().requires_grad_()
        loss = getattr(triplet, loss_name)(Rows(), distance_metric=ours_metric, margin=margin)
        value = loss.compute_loss_from_embeddings([leaf], labels, memory, memory_labels)
        value.backward()

        expected_leaf = rows.clone().requires_grad_()
        distances = dense_distances(upstream_metric, expected_leaf, memory)
        expected = DENSE[loss_name](distances, labels, torch.cat([labels, memory_labels]), margin)
        expected.backward()
        torch.testing.assert_close(value.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(leaf.grad, expected_leaf.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss_name", LOSS_NAMES)
def test_memory_supplies_positives_the_batch_lacks(loss_name):
    """Every label distinct in the batch: no positive pair (batch-hard falls back to a hardest positive
    of 0, upstream's rule); the memory holds two more rows of each class."""
    generator = torch.Generator().manual_seed(0)
    rows, memory = torch.randn(6, 4, generator=generator), torch.randn(12, 4, generator=generator)
    labels, memory_labels = torch.arange(6), torch.arange(12) % 6
    loss = getattr(triplet, loss_name)(Rows(), margin=5)
    plain = loss.compute_loss_from_embeddings([rows], labels)
    with_memory = loss.compute_loss_from_embeddings([rows], labels, memory, memory_labels)
    assert with_memory > plain
    if loss_name != "BatchHardTripletLoss":
        assert plain == 0


def test_batch_all_counts_match_brute_force():
    generator = torch.Generator().manual_seed(2)
    rows, memory = torch.randn(10, 5, generator=generator), torch.randn(30, 5, generator=generator)
    labels, memory_labels = (
        torch.randint(0, 4, (10,), generator=generator),
        torch.randint(0, 4, (30,), generator=generator),
    )
    ref_labels = torch.cat([labels, memory_labels])
    distances = triplet.triplet_distances(triplet.euclidean_distance, rows, memory)
    same, positive = dense_masks(labels, ref_labels)
    valid = positive[:, :, None] & ~same[:, None, :]
    terms = distances[:, :, None] - distances[:, None, :] + 1.0
    assert triplet.batch_all_triplet_counts(distances, labels, ref_labels, 1.0) == (
        int(valid.sum()),
        int((valid & (terms > 0)).sum()),
    )


def test_batch_all_memory_follows_the_distance_matrix_not_the_triplets():
    """32 anchors, 6000 memory rows, 4 classes: ~1.4e8 valid triplets, whose indices alone would take
    3.4 GB; the loss and its backward stay within a few B×R matrices."""
    generator = torch.Generator().manual_seed(0)
    batch, memory_rows = 32, 6000
    rows = torch.randn(batch, 16, generator=generator).requires_grad_()
    memory = torch.randn(memory_rows, 16, generator=generator)
    labels, memory_labels = torch.arange(batch) % 4, torch.arange(memory_rows) % 4
    loss = triplet.BatchAllTripletLoss(Rows(), margin=100.0)
    with measure_peak("cpu") as peak:
        loss.compute_loss_from_embeddings([rows], labels, memory, memory_labels).backward()
    distance_matrix_bytes = batch * (batch + memory_rows) * 4
    valid, active = triplet.batch_all_triplet_counts(
        triplet.triplet_distances(triplet.euclidean_distance, rows.detach(), memory),
        labels,
        torch.cat([labels, memory_labels]),
        100.0,
    )
    assert active == valid > 10**8
    assert peak.peak_bytes < 40 * distance_matrix_bytes, peak


def test_unknown_metric_is_exact_and_warns_with_memory():
    def squared_euclidean(embeddings):
        return triplet.euclidean_distance(embeddings, squared=True)

    generator = torch.Generator().manual_seed(5)
    rows, memory = torch.randn(6, 4, generator=generator), torch.randn(9, 4, generator=generator)
    labels, memory_labels = torch.arange(6) % 3, torch.arange(9) % 3
    loss = triplet.BatchHardTripletLoss(Rows(), distance_metric=squared_euclidean, margin=1.0)
    with pytest.warns(UserWarning, match="no batch-to-memory form"):
        value = loss.compute_loss_from_embeddings([rows], labels, memory, memory_labels)
    expected = dense_batch_hard(
        dense_distances(squared_euclidean, rows, memory), labels, torch.cat([labels, memory_labels]), 1.0
    )
    torch.testing.assert_close(value, expected)


@pytest.mark.parametrize("loss_name", LOSS_NAMES)
def test_upstream_attribute_names_and_config(loss_name):
    """Upstream's defaults and attribute names; a config only where upstream's class has one (5.x+)."""
    loss, reference = getattr(triplet, loss_name)(Rows(), margin=2), getattr(upstream, loss_name)(Rows(), margin=2)
    assert loss.distance_metric is reference.distance_metric
    loss.triplet_margin = 3
    assert loss.margin == 3 and loss.sentence_embedder is loss.model
    assert hasattr(loss, "get_config_dict") == hasattr(reference, "get_config_dict")
    if hasattr(reference, "get_config_dict"):
        for margin_name in ("margin", "triplet_margin"):
            if hasattr(reference, margin_name):
                setattr(reference, margin_name, 3)
        assert loss.get_config_dict() == reference.get_config_dict()


@pytest.mark.parametrize(
    "labels, message",
    [(None, "needs a class label for every text"), (torch.zeros(3, dtype=torch.long), "expects 4 labels")],
)
def test_bad_labels_are_explained(labels, message):
    loss = triplet.BatchAllTripletLoss(Rows())
    with pytest.raises(ValueError, match=message):
        loss([{"rows": torch.randn(4, 3)}], labels)


@pytest.mark.parametrize("margin", [0.3, 1e-3, 0.0])
def test_prefix_counts_are_exact_on_the_margin(margin):
    """Negatives placed on and one float either side of ``d(a, p) + margin``, where the rounded
    threshold that searchsorted sees is wrong: counts must equal the float comparison itself."""
    generator = torch.Generator().manual_seed(0)
    ap = torch.rand(40, generator=generator) + 0.05
    pair_row = torch.arange(40) // 4
    threshold = ap + margin
    below = torch.nextafter(threshold, torch.tensor(-1.0))
    above = torch.nextafter(threshold, torch.tensor(2.0))
    rows = torch.stack(
        [torch.cat([threshold[pair_row == r], below[pair_row == r], above[pair_row == r]]) for r in range(10)]
    )
    rows = torch.cat([rows, torch.rand(10, 20, generator=generator) * 2], dim=1).sort(dim=1).values
    row_length = torch.full((40,), rows.shape[1])
    counts = triplet.count_within(rows, pair_row, row_length, ap, margin)
    expected = ((rows[pair_row] - ap[:, None]) <= margin).sum(1)
    assert torch.equal(counts, expected)
