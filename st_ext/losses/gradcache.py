"""GradCache (https://huggingface.co/papers/2101.06983): batch-sized contrastive losses in mini-batch memory.

A cached loss trades one extra forward pass for memory bounded by the mini-batch:

    (1) embed every mini-batch without a graph, keeping the RNG state each one started from;
    (2) compute the loss over all the embeddings and back-propagate it to the embeddings only:
        those gradients are the cache (the loss may chunk itself and back-propagate chunk by chunk);
    (3) when the trainer calls ``loss.backward()``, re-embed each mini-batch with a graph, under its
        replayed RNG state so dropout draws the same masks, and back-propagate its cached gradient
        through it; one mini-batch graph is alive at a time.

Frozen encoders (a GIST guide) need no gradient, so their embeddings are computed once in (1) and
never again. A loss plugs into :func:`gradcache_forward` by providing the :class:`CachedLoss`
protocol; everything that belongs to one forward pass (features, ranges, RNG states, gradients) is
passed to the backward hook as arguments, so a second forward pass cannot corrupt the first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, Protocol

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import get_device_states, set_device_states
from tqdm.auto import tqdm

Features = dict[str, Any]
Ranges = list[tuple[int, int]]
#: Embeddings per input column, per mini-batch: ``reps[column][mini_batch]`` is ``(rows, dim)``.
Reps = list[list[Tensor]]
#: ``loss_fn(reps, frozen, labels, with_backward=...)``; see :meth:`CachedLoss.loss_from_embeddings`.
LossFn = Callable[..., Tensor]


class CachedLoss(Protocol):
    """What a loss provides to run on :func:`gradcache_forward`."""

    model: nn.Module
    mini_batch_size: int
    mini_batch_num_tokens: int | None
    show_progress_bar: bool

    def frozen_embeddings(self, sentence_features: list[Features], ranges: list[Ranges]) -> Reps | None:
        """Embeddings from frozen encoders, per column (e.g. a guide's); None when the loss needs none."""

    def loss_from_embeddings(
        self, reps: Reps, frozen: Reps | None, labels: Tensor | None, *, with_backward: bool
    ) -> Tensor:
        """The loss over all embeddings. With ``with_backward``, back-propagate it into ``reps`` (chunk
        by chunk if it chunks) and return it detached, so no part of its graph outlives its backward."""


class RngState:
    """The CPU and CUDA generator states one mini-batch's first forward pass started from.

    Replaying them makes the second forward pass draw the same dropout masks, so the cached
    gradients belong to the embeddings they are applied to. The outer RNG is left untouched.
    """

    def __init__(self, tensors: Iterable[Any]) -> None:
        self.cpu_state = torch.get_rng_state()
        self.devices, self.device_states = get_device_states(*[t for t in tensors if isinstance(t, Tensor)])

    @contextmanager
    def replay(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.cpu_state)
            set_device_states(self.devices, self.device_states)
            yield


def batch_size_of(features: Features) -> int:
    """Rows in a column's features (taken from ``input_ids``/``attention_mask`` when present)."""
    for key in ("input_ids", "attention_mask"):
        if isinstance(features.get(key), Tensor):
            return features[key].shape[0]
    return next(value.shape[0] for value in features.values() if isinstance(value, Tensor) and value.ndim > 0)


def row_token_keys(features: Features) -> list[bytes]:
    """One key per row: its non-padding token ids, so the same text has the same key whatever its padding."""
    input_ids = features["input_ids"].detach().cpu().to(torch.int64).numpy()
    mask = features.get("attention_mask")
    if mask is None:
        return [ids.tobytes() for ids in input_ids]
    # numpy, not torch: indexing row by row is ten times faster there, and this runs every step
    return [ids[keep].tobytes() for ids, keep in zip(input_ids, mask.detach().cpu().bool().numpy())]


def minibatch_ranges(features: Features, mini_batch_size: int, mini_batch_num_tokens: int | None = None) -> Ranges:
    """``(begin, end)`` rows of each mini-batch: ``mini_batch_size`` rows each, or, with a token budget,
    as many rows as fit ``mini_batch_num_tokens`` non-padding tokens (a longer row goes alone)."""
    if "cu_seq_lens_q" in features:
        raise ValueError(
            "st_ext's cached losses need padded batches; flattened inputs (DataCollatorWithFlattening) "
            "cannot be split into mini-batches here."
        )
    rows = batch_size_of(features)
    if mini_batch_num_tokens is None:
        return [(begin, min(begin + mini_batch_size, rows)) for begin in range(0, rows, mini_batch_size)]
    if not isinstance(features.get("attention_mask"), Tensor):
        raise ValueError("mini_batch_num_tokens needs an attention_mask to count tokens; use mini_batch_size.")
    ranges, begin, used = [], 0, 0
    for row, length in enumerate(features["attention_mask"].sum(dim=1).tolist()):
        if row > begin and used + length > mini_batch_num_tokens:
            ranges.append((begin, row))
            begin, used = row, 0
        used += length
    if rows:
        ranges.append((begin, rows))
    return ranges


def validate_mini_batching(mini_batch_size: int, mini_batch_num_tokens: int | None) -> None:
    """Fail at construction rather than at the first batch."""
    if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or mini_batch_size <= 0:
        raise ValueError(f"mini_batch_size must be a positive integer, got {mini_batch_size!r}.")
    if mini_batch_num_tokens is not None and mini_batch_num_tokens <= 0:
        raise ValueError(f"mini_batch_num_tokens must be a positive integer or None, got {mini_batch_num_tokens!r}.")


def slice_minibatch(features: Features, begin: int, end: int) -> Features:
    """Rows ``begin:end`` of a column, without the trailing padding columns all of them share.

    Trimming keeps a mini-batch of short texts from being embedded at the width of the batch's
    longest text; leading padding is kept so positions do not shift. Non-tensor values pass through.
    """
    mask = features.get("attention_mask")
    width = seq_len = None
    if isinstance(mask, Tensor) and mask.ndim == 2:
        seq_len = mask.shape[1]
        active = mask[begin:end].bool().any(dim=0).nonzero()
        width = int(active.max()) + 1 if len(active) else seq_len
    minibatch = {}
    for key, value in features.items():
        if isinstance(value, Tensor) and value.ndim >= 1:
            value = value[begin:end]
            if width is not None and value.ndim >= 2 and value.shape[1] == seq_len:
                value = value[:, :width]
        minibatch[key] = value
    return minibatch


def embed_without_grad(
    model: nn.Module,
    sentence_features: Sequence[Features],
    ranges: Sequence[Ranges],
    *,
    keep_rng: bool,
    show_progress_bar: bool = False,
) -> tuple[Reps, list[list[RngState | None]]]:
    """Step (1): every mini-batch's embeddings, and the RNG state each forward started from."""
    reps, rng_states = [], []
    for features, column_ranges in zip(sentence_features, ranges):
        column_reps, column_states = [], []
        for begin, end in tqdm(column_ranges, desc="Embed mini-batches", disable=not show_progress_bar):
            minibatch = slice_minibatch(features, begin, end)
            column_states.append(RngState(minibatch.values()) if keep_rng else None)
            with torch.no_grad():
                column_reps.append(_compact(model(minibatch)["sentence_embedding"]))
        reps.append(column_reps)
        rng_states.append(column_states)
    return reps, rng_states


def _compact(rep: Tensor) -> Tensor:
    """``rep`` in storage of its own: a pooled view (CLS pooling) would otherwise keep the whole
    mini-batch's token embeddings alive until the step ends."""
    if rep.untyped_storage().nbytes() > rep.numel() * rep.element_size():
        return rep.clone()
    return rep


@dataclass(frozen=True)
class ReplayPlan:
    """Everything step (3) needs from one forward pass, captured when that pass ends."""

    model: nn.Module
    sentence_features: list[Features]
    ranges: list[Ranges]
    rng_states: list[list[RngState]]
    grads: Reps
    show_progress_bar: bool = False


def replay_backward(grad_output: Tensor, plan: ReplayPlan) -> None:
    """Step (3), a hook on the loss: re-embed each mini-batch with a graph, back-propagate its cached gradient.

    ``grad_output`` is what the outer backward hands the loss (the fp16 scaler's scale, the
    gradient-accumulation divisor), so every mini-batch receives it. Under DDP only the last
    mini-batch synchronises gradients.
    """
    jobs = [
        (features, begin, end, state, grad)
        for features, column_ranges, states, grads in zip(
            plan.sentence_features, plan.ranges, plan.rng_states, plan.grads
        )
        for (begin, end), state, grad in zip(column_ranges, states, grads)
    ]
    with torch.enable_grad():
        for index, (features, begin, end, state, grad) in enumerate(
            tqdm(jobs, desc="Backward mini-batches", disable=not plan.show_progress_bar)
        ):
            with _sync_unless_last(plan.model, last=index == len(jobs) - 1):
                with state.replay():
                    reps = plan.model(slice_minibatch(features, begin, end))["sentence_embedding"]
                if reps.requires_grad:
                    _surrogate(reps, grad, grad_output).backward()


def _surrogate(reps: Tensor, grad: Tensor, grad_output: Tensor) -> Tensor:
    """A scalar whose gradient wrt ``reps`` is ``grad * grad_output``, computed in at least fp32."""
    dtype = torch.promote_types(torch.promote_types(reps.dtype, grad.dtype), torch.float32)
    return torch.dot(reps.flatten().to(dtype), grad.flatten().to(dtype)) * grad_output


def _sync_unless_last(model: nn.Module, last: bool):
    if isinstance(model, DistributedDataParallel) and not last:
        return model.no_sync()
    return nullcontext()


def gradcache_forward(
    loss: CachedLoss,
    sentence_features: Iterable[Features],
    labels: Tensor | None,
    loss_fn: LossFn | None = None,
) -> Tensor:
    """Run steps (1) and (2) and return a loss whose ``backward()`` runs step (3).

    ``loss_fn`` replaces ``loss.loss_from_embeddings`` when a wrapper (Matryoshka) computes the
    loss over transformed embeddings; it follows the same contract.
    """
    loss_fn = loss_fn or loss.loss_from_embeddings
    sentence_features = list(sentence_features)
    mini_batch_num_tokens = getattr(loss, "mini_batch_num_tokens", None)
    ranges = [minibatch_ranges(f, loss.mini_batch_size, mini_batch_num_tokens) for f in sentence_features]
    show_progress_bar = getattr(loss, "show_progress_bar", False)
    # Frozen encoders first: they read the features before any module edits them in place.
    frozen = loss.frozen_embeddings(sentence_features, ranges)
    grad_enabled = torch.is_grad_enabled()
    reps, rng_states = embed_without_grad(
        loss.model, sentence_features, ranges, keep_rng=grad_enabled, show_progress_bar=show_progress_bar
    )
    if not grad_enabled:
        return loss_fn(reps, frozen, labels, with_backward=False)

    reps = [[rep.detach().requires_grad_() for rep in column] for column in reps]
    value = loss_fn(reps, frozen, labels, with_backward=True)
    grads = [[rep.grad for rep in column] for column in reps]
    unused = [str(index) for index, column in enumerate(grads) if any(grad is None for grad in column)]
    if unused:
        raise ValueError(
            f"{type(loss).__name__} did not use input column(s) {', '.join(unused)}: their embeddings got no "
            "gradient. Remove the unused column(s) from the dataset."
        )
    plan = ReplayPlan(loss.model, sentence_features, ranges, rng_states, grads, show_progress_bar)
    result = value.detach().requires_grad_()
    result.register_hook(partial(replay_backward, plan=plan))
    return result


def chunked_rows(batch_size: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    """``(begin, end)`` row blocks for computing a loss's score matrix a block at a time."""
    for begin in range(0, batch_size, chunk_size):
        yield begin, min(begin + chunk_size, batch_size)
