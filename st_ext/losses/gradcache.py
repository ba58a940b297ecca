"""GradCache (https://huggingface.co/papers/2101.06983): batch-sized contrastive losses in mini-batch memory.

A cached loss trades one extra forward pass for memory bounded by the mini-batch:

    (1) embed every mini-batch without a graph, keeping the RNG state each one started from;
    (2) compute the loss over all the embeddings and back-propagate it to the embeddings only:
        those gradients are the cache (the loss may chunk itself and back-propagate chunk by chunk);
    (3) when the trainer calls ``loss.backward()``, re-embed each mini-batch with a graph, under its
        replayed RNG state so dropout draws the same masks, and back-propagate its cached gradient
        through it; one mini-batch graph is alive at a time.

Partial caching: where memory holds the graphs of some mini-batches (``kept_graphs``, or what
``mini_batch_size="auto"`` measured), the first of them are embedded in (1) with a graph, which is
kept; in (3) their cached gradients are back-propagated through those graphs, in one backward before
the replays, and only the other mini-batches are re-embedded. When every graph is kept (one
mini-batch holds the whole batch, or ``kept_graphs`` covers them all), (1)-(3) buy nothing and the
plain forward and backward run instead. Frozen encoders (a GIST guide) are embedded once, in (1).
Everything that belongs to one forward pass is handed to its backward as arguments, so a second
forward pass cannot corrupt the first.

What the engine runs is a :class:`CachedLoss`: the model, the mini-batch setting, and ``start``, which opens one
forward pass (a :class:`LossStep`: the loss function of each output, the encoder that makes the outputs, and
what joins the batch from outside it). st_ext's losses describe themselves (their ``cached_loss()`` method);
upstream's cached losses are described by :func:`st_ext.losses.loss_descriptions.as_cached_loss`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import get_device_states
from tqdm.auto import tqdm

from st_ext import checkpointing
from st_ext._compat import st_modules, unwrapped_model
from st_ext.gradient_sync import gradient_sync, parameters_sharded, without_forward_collectives
from st_ext.losses.auto_mini_batch import AUTO, AutoMiniBatch
from st_ext.losses.features import (  # noqa: F401  (Ranges, batch_size_of, row_keys: re-exported for the losses)
    ColumnLayout,
    Features,
    Ranges,
    UnsliceableFeatureError,
    batch_size_of,
    layout_of,
    minibatch_features,
    row_keys,
)
from st_ext.losses.loss_functions import BatchJoin, Encoder, LossFn, Reps, Source
from st_ext.losses.minibatches import MiniBatch, MiniBatchPlan, plan_minibatches


@dataclass(frozen=True)
class LossStep:
    """One forward pass of a cached loss.

    ``loss_for(source)`` is the loss function of one output; each call draws what the loss draws per call
    (Matryoshka's dimensions), so a layer-wise loss calls it once per layer, in upstream's order. ``encoder``
    (None: the model's sentence embedding alone) embeds each mini-batch; ``join`` (None: nothing) adds
    embeddings from outside the batch. A step whose loss spans several outputs (a layer-wise loss's, the
    multi-vector loss's) overrides :meth:`loss`.
    """

    loss_for: Callable[[Source], LossFn]
    encoder: Encoder | None = None
    join: BatchJoin | None = None

    def sources(self) -> list[Source]:
        """Where each output of ``encoder`` comes from (known once the first mini-batch is embedded)."""
        return [None]

    def loss(self, outputs: list[Reps], labels: Tensor | None, *, with_backward: bool) -> Tensor:
        """The step's loss over every output (each with the columns ``join`` added)."""
        return self.loss_for(None)(outputs[0], labels, with_backward=with_backward)


#: ``start(sentence_features, ranges, mini_batch_size)``: opens one forward pass of a cached loss.
StartStep = Callable[[list[Features], list[Ranges], int], LossStep]


@dataclass(frozen=True)
class CachedLoss:
    """A loss over cached embeddings, as the engine runs it.

    ``mini_batch_size`` is a number or ``"auto"`` (resolved by ``auto``, an
    :class:`~st_ext.losses.auto_mini_batch.AutoMiniBatch`, which also chooses how many graphs to keep);
    ``kept_graphs``: with a number, how many mini-batches keep their graph for the backward instead of
    being embedded again (0: every one is). ``start(sentence_features, ranges,
    mini_batch_size)`` opens a forward pass before any mini-batch is embedded, with each column's
    mini-batch row ranges (a frozen encoder embeds the same ones) and the size resolved for this batch (a
    loss that scores its anchors a block at a time uses it as its block). ``terms``: empty, the loss is a
    number; else the names of the terms its loss functions return, one value each (a sum of losses over
    the same embeddings), and the engine returns them by name.
    """

    name: str
    model: nn.Module
    start: StartStep
    mini_batch_size: int | Literal["auto"]
    mini_batch_num_tokens: int | None = None
    auto: AutoMiniBatch | None = None
    show_progress_bar: bool = False
    kept_graphs: int = 0
    terms: tuple[str, ...] = ()


def described(loss: Any, start: StartStep) -> CachedLoss:
    """A loss that keeps a cached loss's usual settings (``model``, ``mini_batch_size``, and where it has
    them ``mini_batch_num_tokens``, ``auto_mini_batch``, ``show_progress_bar``, ``kept_graphs``), with
    ``start``."""
    return CachedLoss(
        name=type(loss).__name__,
        model=loss.model,
        start=start,
        mini_batch_size=loss.mini_batch_size,
        mini_batch_num_tokens=getattr(loss, "mini_batch_num_tokens", None),
        auto=getattr(loss, "auto_mini_batch", None),
        show_progress_bar=getattr(loss, "show_progress_bar", False),
        kept_graphs=getattr(loss, "kept_graphs", None) or 0,
    )


class RngState:
    """The CPU and accelerator generator states one mini-batch's first forward pass started from,
    replayed by its second pass (the outer RNG is left untouched). CUDA-like devices keep one
    generator per device; MPS has a single one and no per-device context, so it is kept on its own.
    """

    def __init__(self, tensors: Iterable[Any]) -> None:
        accelerated = [t for t in tensors if isinstance(t, Tensor) and t.device.type not in ("cpu", "meta")]
        self.cpu_state = torch.get_rng_state()
        self.mps_state = torch.mps.get_rng_state() if any(t.device.type == "mps" for t in accelerated) else None
        per_device = [t for t in accelerated if t.device.type != "mps"]
        self.device_type = per_device[0].device.type if per_device else None
        self.devices, self.device_states = get_device_states(*per_device)

    @contextmanager
    def replay(self) -> Iterator[None]:
        fork = torch.random.fork_rng(devices=self.devices, device_type=self.device_type or "cuda")
        with fork, _single_generator_replay(self.mps_state):
            torch.set_rng_state(self.cpu_state)
            # Through the tensors' own device module: set_device_states picks the default accelerator's.
            if self.device_type is not None:
                device_module = getattr(torch, self.device_type)
                for device, state in zip(self.devices, self.device_states):
                    device_module.set_rng_state(state, device)
            yield


@contextmanager
def _single_generator_replay(state: Tensor | None) -> Iterator[None]:
    if state is None:
        yield
        return
    outer = torch.mps.get_rng_state()
    torch.mps.set_rng_state(state)
    try:
        yield
    finally:
        torch.mps.set_rng_state(outer)


def embeds_with_static_embedding(model: nn.Module) -> bool:
    """Whether the model's input module (or a ``Router``/``Asym`` route's first) is a ``StaticEmbedding``:
    its features are one flat bag of token ids with offsets, which cannot be split into mini-batches."""
    static_embedding = getattr(st_modules(), "StaticEmbedding", None)
    model = unwrapped_model(model)
    if static_embedding is None or not isinstance(model, nn.Sequential) or not len(model):
        return False
    first = model[0]
    routes = getattr(first, "sub_modules", None)
    inputs = (
        [next(iter(route), None) for route in routes.values()]
        if routes is not None and hasattr(routes, "values")
        else [first]
    )
    return any(isinstance(module, static_embedding) for module in inputs)


def column_layouts(model: nn.Module, sentence_features: Sequence[Features]) -> list[ColumnLayout]:
    """Every column's layout; a feature no rule can cut stops the step, naming the model's input module
    (and the Hugging Face model inside it, e.g. ``Transformer (Qwen2VLModel)``)."""
    try:
        return [layout_of(features) for features in sentence_features]
    except UnsliceableFeatureError as error:
        model = unwrapped_model(model)
        first = model[0] if isinstance(model, nn.Sequential) and len(model) else model
        inner = getattr(first, "auto_model", None)
        name = type(first).__name__ + (f" ({type(inner).__name__})" if isinstance(inner, nn.Module) else "")
        raise UnsliceableFeatureError(f"{error} The features come from {name}.") from None


def sentence_embedding(model: nn.Module, features: Features) -> list[Tensor]:
    """What a mini-batch is embedded to unless the loss brings its own encoder."""
    return [model(features)["sentence_embedding"]]


def embed_minibatches(
    model: nn.Module,
    sentence_features: Sequence[Features],
    plan: MiniBatchPlan,
    *,
    keep_rng: bool,
    encoder: Encoder,
    show_progress_bar: bool = False,
) -> tuple[list[Reps], list[RngState | None]]:
    """Every mini-batch's outputs, split back into columns (``outputs[output][column][mini_batch]``), and
    the RNG state each forward started from, in the caller's gradient mode."""
    outputs: list[Reps] = []
    rng_states: list[RngState | None] = []
    for minibatch in tqdm(plan.minibatches, desc="Embed mini-batches", disable=not show_progress_bar):
        features = minibatch_features(sentence_features, plan.layouts, minibatch)
        rng_states.append(RngState(features.values()) if keep_rng else None)
        for index, output in enumerate(encoder(model, features)):
            if index == len(outputs):
                outputs.append([[] for _ in plan.layouts])
            if not output.requires_grad and output.untyped_storage().nbytes() > output.numel() * output.element_size():
                # In storage of its own: a pooled view (CLS pooling) would keep the whole mini-batch's token
                # embeddings alive until the step ends.
                output = output.clone()
            for segment, rows in zip(minibatch, output.split([segment.end - segment.begin for segment in minibatch])):
                outputs[index][segment.column].append(rows)
    return outputs, rng_states


def replay_backward(
    grad_output: Tensor,
    model: nn.Module,
    sentence_features: list[Features],
    plan: MiniBatchPlan,
    rng_states: list[RngState | None],
    grads: list[list[Tensor | None]],
    *,
    encoder: Encoder,
    checkpointing: bool,
    show_progress_bar: bool,
    kept: list[list[Tensor]] | None = None,
) -> None:
    """Step (3). ``grad_output`` (the fp16 scaler's scale, the gradient-accumulation divisor) scales every
    mini-batch. ``kept`` holds the outputs, with their graphs, of the first mini-batches (emptied here, so
    the graphs go with the backward): they back-propagate first, in one backward, and the others are
    replayed. Under a distributed engine only the last mini-batch reduces gradients across ranks; when
    that one back-propagates nothing (a frozen route), the last one that did is replayed once more with
    a zero gradient inside the reducing context, so the step still reduces, once, on every rank.
    """
    kept_outputs = list(kept or [])
    if kept:
        kept.clear()

    def replay(minibatch: MiniBatch, state: RngState | None, cached: list[Tensor | None], scale: Tensor) -> bool:
        """False when none of the mini-batch's outputs needs a gradient."""
        assert state is not None, "a graph pass keeps each mini-batch's RNG state"
        with state.replay():
            # Not bound to a name: a SentenceTransformer writes its token embeddings into the features it is
            # given, which would then stay alive through the backward.
            outputs = encoder(model, minibatch_features(sentence_features, plan.layouts, minibatch))
        pairs = [(out, grad) for out, grad in zip(outputs, cached) if grad is not None and out.requires_grad]
        if pairs:
            _surrogates_backward(pairs, scale)
        return bool(pairs)

    last = len(plan.minibatches) - 1
    jobs = list(zip(plan.minibatches, rng_states, grads))
    last_trained = None
    with torch.enable_grad(), checkpointed(model, checkpointing):
        if kept_outputs:
            with gradient_sync(model, sync=False):
                last_trained = _kept_backward(kept_outputs, grads, grad_output)
        replayed = jobs[len(kept_outputs) :]
        for index, (minibatch, state, cached) in enumerate(
            tqdm(replayed, desc="Backward mini-batches", disable=not show_progress_bar), start=len(kept_outputs)
        ):
            with gradient_sync(model, sync=index == last):
                if replay(minibatch, state, cached, grad_output):
                    last_trained = index
        if last_trained is not None and last_trained != last:
            with gradient_sync(model, sync=True), without_forward_collectives(model):
                replay(*jobs[last_trained], torch.zeros_like(grad_output))


def _kept_backward(kept: list[list[Tensor]], grads: list[list[Tensor | None]], scale: Tensor) -> int | None:
    """Back-propagate the cached gradients of the kept mini-batches through their graphs, all in one backward
    (a distributed engine sees one backward, whatever their number); the index of the last of them that had
    a gradient to back-propagate, or None."""
    pairs, last_trained = [], None
    for index, (outputs, cached) in enumerate(zip(kept, grads)):
        trained = [(out, grad) for out, grad in zip(outputs, cached) if grad is not None and out.requires_grad]
        if trained:
            pairs += trained
            last_trained = index
    if pairs:
        _surrogates_backward(pairs, scale)
    return last_trained


def _surrogates_backward(pairs: Sequence[tuple[Tensor, Tensor]], scale: Tensor) -> None:
    """One backward of the sum of every pair's :func:`_surrogate`, times ``scale``."""
    total = _surrogate(*pairs[0])
    for out, grad in pairs[1:]:
        total = total + _surrogate(out, grad)
    total.mul(scale).backward()


def _surrogate(reps: Tensor, grad: Tensor) -> Tensor:
    """A scalar whose gradient wrt ``reps`` is ``grad``, computed in at least fp32."""
    dtype = torch.promote_types(torch.promote_types(reps.dtype, grad.dtype), torch.float32)
    return torch.dot(reps.flatten().to(dtype), grad.flatten().to(dtype))


def _minibatch_pieces(outputs: list[Reps], plan: MiniBatchPlan) -> list[list[list[Tensor]]]:
    """``pieces[mini_batch][output]``: the mini-batch's rows of each output, one piece per segment."""
    columns_of = [[iter(column) for column in output] for output in outputs]
    return [
        [[next(columns[segment.column]) for segment in minibatch] for columns in columns_of]
        for minibatch in plan.minibatches
    ]


def _output_grads(outputs: list[Reps], plan: MiniBatchPlan) -> list[list[Tensor | None]]:
    """``grads[mini_batch][output]``: zeros for a segment that got no gradient, None for an output that got none."""
    grads: list[list[Tensor | None]] = []
    for per_output in _minibatch_pieces(outputs, plan):
        grads.append([])
        for reps in per_output:
            if all(rep.grad is None for rep in reps):
                grads[-1].append(None)
                continue
            parts = [torch.zeros_like(rep) if rep.grad is None else rep.grad for rep in reps]
            grads[-1].append(parts[0] if len(parts) == 1 else torch.cat(parts))
    return grads


def _joined(pieces: list[list[list[Tensor]]]) -> list[list[Tensor]]:
    """Each mini-batch's output rows in one tensor, as its forward pass returned them."""
    return [[parts[0] if len(parts) == 1 else torch.cat(parts) for parts in per_output] for per_output in pieces]


def checkpointed(model: nn.Module, on: bool) -> AbstractContextManager:
    """Gradient checkpointing on in the block where the auto mode chose it (the model is left as it was)."""
    return checkpointing.switched_on(model) if on else nullcontext()


@dataclass(frozen=True)
class Sizing:
    """How this batch is embedded: rows (or tokens) per mini-batch, whether the graph passes checkpoint,
    and how many mini-batches keep their graph for the backward (the first ones)."""

    size: int
    num_tokens: int | None = None
    checkpointing: bool = False
    kept_graphs: int = 0


def resolve_mini_batching(
    loss: CachedLoss, sentence_features: Sequence[Features], layouts: Sequence[ColumnLayout]
) -> Sizing:
    """This batch's :class:`Sizing` for a :class:`~st_ext.losses.gradcache.CachedLoss`, ``"auto"``
    resolved by its :class:`AutoMiniBatch`. Nothing is written on the loss: the engine hands the size on."""
    if loss.mini_batch_size != AUTO:
        return Sizing(loss.mini_batch_size, loss.mini_batch_num_tokens, kept_graphs=loss.kept_graphs)
    if parameters_sharded(loss.model):
        raise ValueError(
            f"{loss.name}: mini_batch_size='auto' measures each rank on its own, which a model whose "
            "parameters are sharded across ranks (FSDP, DeepSpeed ZeRO-3) cannot do: every forward pass is a "
            "collective. Set a fixed mini_batch_size, e.g. the size an unsharded run chose."
        )
    auto = loss.auto
    assert auto is not None, "a cached loss built with mini_batch_size='auto' carries its AutoMiniBatch"
    choice = auto.choice_for(loss.model, sentence_features, layouts)
    return Sizing(choice.size, None, choice.checkpointing, choice.kept)


def gradcache_forward(
    loss: CachedLoss, sentence_features: Iterable[Features], labels: Tensor | None
) -> Tensor | dict[str, Tensor]:
    """Run steps (1) and (2) of ``loss`` (a :class:`~st_ext.losses.gradcache.CachedLoss`) and return a
    loss whose ``backward()`` runs step (3) (or, when every mini-batch keeps its graph, the plain loss with
    its graph); a loss with ``terms``, each term by name (their sum back-propagates)."""
    sentence_features = list(sentence_features)
    layouts = column_layouts(loss.model, sentence_features)
    batching = resolve_mini_batching(loss, sentence_features, layouts)
    plan = plan_minibatches(sentence_features, layouts, batching.size, batching.num_tokens)
    grad_enabled = torch.is_grad_enabled()
    kept = len(plan.minibatches) if plan.single_pass else min(batching.kept_graphs, len(plan.minibatches))
    kept = kept if grad_enabled else 0
    kept_plan, replayed_plan = plan.split(kept)
    # Before the passes that embed the features (the auto mode's probes embed copies): the loss and its frozen
    # encoders read them before a module edits them in place.
    step = loss.start(sentence_features, plan.column_ranges(), batching.size)
    encoder = step.encoder or sentence_embedding

    def loss_over(outputs: list[Reps], *, with_backward: bool) -> Tensor:
        """The step's loss, each output with the columns its join adds for its source (not the join's to enqueue)."""
        if step.join is not None:
            outputs = [reps + step.join.columns(source, reps[0][0]) for source, reps in zip(step.sources(), outputs)]
        return step.loss(outputs, labels, with_backward=with_backward)

    def finished(outputs: list[Reps], value: Tensor) -> Tensor | dict[str, Tensor]:
        if step.join is not None:
            step.join.after_step(step.sources(), outputs, labels)
        return dict(zip(loss.terms, value.unbind(), strict=True)) if loss.terms else value

    if grad_enabled and kept == len(plan.minibatches):
        with checkpointed(loss.model, batching.checkpointing):
            outputs, _ = embed_minibatches(loss.model, sentence_features, plan, keep_rng=False, encoder=encoder)
        return finished(outputs, loss_over(outputs, with_backward=False))
    embed = partial(
        embed_minibatches,
        loss.model,
        sentence_features,
        keep_rng=grad_enabled,
        show_progress_bar=loss.show_progress_bar,
        encoder=encoder,
    )
    # A distributed engine decides at forward time whether a graph's backward reduces (DDP): the kept
    # graphs' backward never does, since replayed mini-batches follow it.
    kept_outputs: list[Reps] = []
    kept_rng_states: list[RngState | None] = []
    if kept:
        with checkpointed(loss.model, batching.checkpointing), gradient_sync(loss.model, sync=False):
            kept_outputs, kept_rng_states = embed(kept_plan)
    with torch.no_grad():
        outputs, rng_states = embed(replayed_plan)
    outputs = _concatenated(kept_outputs, outputs)
    rng_states = kept_rng_states + rng_states
    if not grad_enabled:
        return finished(outputs, loss_over(outputs, with_backward=False))

    graphs = _joined(_minibatch_pieces(outputs, kept_plan))
    outputs = [[[rep.detach().requires_grad_() for rep in column] for column in output] for output in outputs]
    value = loss_over(outputs, with_backward=True)
    unused = [str(index) for index, column in enumerate(outputs[0]) if any(rep.grad is None for rep in column)]
    if unused:
        raise ValueError(
            f"{loss.name} did not use input column(s) {', '.join(unused)}: their embeddings got no "
            "gradient. Remove the unused column(s) from the dataset."
        )
    replay = partial(
        replay_backward,
        model=loss.model,
        sentence_features=sentence_features,
        plan=plan,
        rng_states=rng_states,
        grads=_output_grads(outputs, plan),
        encoder=encoder,
        checkpointing=batching.checkpointing,
        show_progress_bar=loss.show_progress_bar,
        kept=graphs,
    )
    return finished(outputs, _ReplayOnBackward.apply(value.detach().requires_grad_(), replay))


def _concatenated(first: list[Reps], then: list[Reps]) -> list[Reps]:
    """Two runs of mini-batches' outputs (``outputs[output][column][mini_batch]``) as one, in order."""
    if not first or not then:
        return first or then
    return [[a + b for a, b in zip(one, other)] for one, other in zip(first, then)]


class _ReplayOnBackward(torch.autograd.Function):
    """The loss's value, whose backward runs step (3): made by an operation (with a ``grad_fn``), as
    DeepSpeed's ``engine.backward`` requires; the leaf it is made from receives no gradient. A value of
    several terms back-propagates their sum: the cached gradient is the sum's, so every term must get the
    same output gradient."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, replay: Callable[[Tensor], None]) -> Tensor:
        ctx.replay = replay
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[None, None]:
        if grad_output.ndim:
            first = grad_output[0]
            if not bool((grad_output == first).all()):
                raise ValueError(
                    "The terms of a cached loss over shared embeddings back-propagate together: call backward() on "
                    "their sum (as the trainers do), not on some of them or a reweighting of them."
                )
            grad_output = first
        ctx.replay(grad_output)
        return None, None


def chunked_rows(batch_size: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    """``(begin, end)`` row blocks for computing a loss's score matrix a block at a time."""
    for begin in range(0, batch_size, chunk_size):
        yield begin, min(begin + chunk_size, batch_size)
