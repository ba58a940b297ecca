"""Shared helpers for the cached-loss tests: batches, gradients after one backward, comparisons, memory."""

from __future__ import annotations

import random

import torch
from datasets import Dataset
from tiny_models import WORDS, sentence_transformer_from

from st_ext import SentenceTransformer
from st_ext._compat import preprocess, separate_column_forwards
from st_ext.memory import measure_peak


def random_texts(count: int, seed: int, min_words: int = 3, max_words: int = 14) -> list[str]:
    """Distinct random sentences over the tiny vocabulary (distinct, so no in-batch duplicate is masked)."""
    rng = random.Random(seed)
    texts: dict[str, None] = {}
    while len(texts) < count:
        texts[" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))] = None
    return list(texts)


def text_columns(batch_size: int, num_columns: int, seed: int = 0, **kwargs) -> list[list[str]]:
    """(anchor, positive, negative_1..) columns of a batch, all texts distinct."""
    texts = random_texts(batch_size * num_columns, seed, **kwargs)
    return [texts[i * batch_size : (i + 1) * batch_size] for i in range(num_columns)]


def long_columns(batch_size: int) -> list[list[str]]:
    """(anchor, positive) columns of long texts, seeded by the batch size: for memory measurements."""
    return text_columns(batch_size, 2, seed=batch_size, min_words=10, max_words=16)


def features_of(model, columns: list[list[str]]) -> list[dict]:
    return [preprocess(model, column) for column in columns]


def loss_and_grads(
    model, loss, columns, *, train: bool, seed: int = 1, featurize=features_of
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss value and every parameter's gradient after one forward and backward from a fixed RNG.

    Non-cached upstream references embed one column per forward pass, the order cached losses replay,
    so that with dropout on both draw the same masks. ``featurize(model, columns)`` tokenizes the batch.
    """
    model.zero_grad(set_to_none=True)
    model.train(train)
    features = featurize(model, columns)
    torch.manual_seed(seed)
    random.seed(seed)
    with separate_column_forwards():
        value = loss(features, None)
    value.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return value.detach(), grads


def assert_same_grads(actual, expected, rtol: float = 1e-4) -> None:
    """Same loss, and every parameter's gradient equal up to float32 noise (relative to its own scale)."""
    actual_value, actual_grads = actual
    expected_value, expected_grads = expected
    torch.testing.assert_close(actual_value, expected_value, rtol=rtol, atol=1e-6)
    assert actual_grads.keys() == expected_grads.keys()
    scale = max(grad.abs().max().item() for grad in expected_grads.values())
    for name, grad in expected_grads.items():
        torch.testing.assert_close(actual_grads[name], grad, rtol=rtol, atol=1e-5 * scale, msg=name)


def assert_losses_agree(model, actual_loss, expected_loss, columns, *, train: bool) -> None:
    """Both losses give the same value and gradients on the same batch from the same RNG state."""
    assert_same_grads(
        loss_and_grads(model, actual_loss, columns, train=train),
        loss_and_grads(model, expected_loss, columns, train=train),
    )


def grads_differ(first, second, rtol: float = 1e-3) -> bool:
    _, a = first
    _, b = second
    return any(not torch.allclose(a[name], b[name], rtol=rtol, atol=1e-6) for name in b)


class CopyingSentenceTransformer(SentenceTransformer):
    """Runs on a copy of its input dict.

    sentence-transformers 4.x's non-cached GISTEmbedLoss runs the guide on the very dicts the model
    filled, which upstream's MatryoshkaLoss reuses for the smaller dimensions; a guide that writes
    into a copy keeps that reference honest on every version.
    """

    def forward(self, features, *args, **kwargs):
        return super().forward(dict(features), *args, **kwargs)


def guide_from(path, max_seq_length: int | None = None):
    guide = sentence_transformer_from(path, model_class=CopyingSentenceTransformer)
    if max_seq_length is not None:
        guide.max_seq_length = max_seq_length
    return guide.eval()


def peak_training_bytes(model, loss, columns) -> int:
    """Peak tensor memory of one forward and backward, measured by st_ext.memory on the CPU."""
    features = features_of(model, columns)
    model.zero_grad(set_to_none=True)
    with measure_peak("cpu") as peak:
        loss(features, None).backward()
    model.zero_grad(set_to_none=True)
    return peak.peak_bytes


def steady_step_peak(model, loss, features) -> int:
    """Peak tensor memory of a forward and backward after a first, unmeasured one (where lazily built caches
    and the auto mode's measuring happen), measured by st_ext.memory on the CPU."""
    model.zero_grad(set_to_none=True)
    loss(features, None).backward()
    model.zero_grad(set_to_none=True)
    with measure_peak("cpu") as peak:
        loss(features, None).backward()
    model.zero_grad(set_to_none=True)
    return peak.peak_bytes


def assert_bounded_by_the_mini_batch(model, cached, reference) -> None:
    """From batch 16 to 128 at a mini-batch of 16, ``cached``'s peak stays within 1.25x while the
    non-cached ``reference``'s at least triples (the premise), ending 3x above the cached one."""
    small, large = long_columns(16), long_columns(128)
    cached_small = peak_training_bytes(model, cached, small)
    cached_large = peak_training_bytes(model, cached, large)
    reference_small = peak_training_bytes(model, reference, small)
    reference_large = peak_training_bytes(model, reference, large)
    assert cached_large <= 1.25 * cached_small, (cached_small, cached_large)
    assert reference_large >= 3 * reference_small, (reference_small, reference_large)
    assert cached_large * 3 <= reference_large, (cached_large, reference_large)


def pair_dataset(rows: int, seed: int = 0, negatives: int = 0) -> Dataset:
    names = ["anchor", "positive"] + [f"negative_{i + 1}" for i in range(negatives)]
    columns = text_columns(rows, len(names), seed)
    return Dataset.from_dict(dict(zip(names, columns)))


class NoDeviceReads(torch.Tensor):
    """A tensor whose values may not be read on the host: every such read raises."""

    FORBIDDEN = {"item", "tolist", "nonzero", "__bool__", "__int__", "__index__", "cpu", "numpy", "any", "all"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in cls.FORBIDDEN:
            raise AssertionError(f"{func.__name__} read device data")
        return super().__torch_function__(func, types, args, kwargs or {})
