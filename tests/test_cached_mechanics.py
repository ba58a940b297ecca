"""How st_ext's cached losses behave around the training loop, each compared with a reference.

A cached loss returns a value whose ``backward()`` re-embeds the batch one mini-batch at a time and
back-propagates cached gradients through it. That deferred backward meets everything a trainer does
around a loss: mixed precision, a scaled loss (gradient accumulation, loss scaling), a loss tensor that
outlives its step, several forward passes before one backward, a compiled model, dropout, and
accelerators with their own random generators. Each test below holds st_ext's
``CachedGISTEmbedLoss``, ``MatryoshkaLoss`` over upstream's ``CachedMultipleNegativesRankingLoss`` and
over st_ext's ``CachedGISTEmbedLoss``, and ``CrossBatchMemoryLoss`` over a cached loss to the
non-cached loss, or to the cached loss under plain conditions.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import sentence_transformers
import torch
from loss_checks import assert_same_grads, features_of, loss_and_grads, pair_dataset, text_columns
from tiny_models import save_tiny_bert, sentence_transformer_from
from torch import nn

import st_ext
from st_ext import _compat, losses
from st_ext._compat import separate_column_forwards, st_losses, st_modules
from st_ext.gradient_sync import gradient_sync
from st_ext.losses.features import layout_of, slice_rows
from st_ext.losses.gradcache import CachedLoss, LossStep, gradcache_forward

upstream = st_losses()
pytestmark = pytest.mark.usefixtures("one_torch_thread")

DIMS = [32, 16, 8]
BATCH = 8
MINI_BATCH = 3  # 8 rows -> mini-batches of 3, 3 and 2: uneven on purpose


@dataclass(frozen=True)
class Case:
    """A cached loss and its non-cached references, each built fresh for a model and a guide.

    ``reference`` is upstream's non-cached loss. ``same_arithmetic`` is the non-cached loss that computes
    the loss over embeddings with the same operations as the cached one (st_ext's GIST losses share one
    function); under bf16 the two may round differently, so precision tests compare with it.
    """

    cached: Callable[[nn.Module, nn.Module], nn.Module]
    reference: Callable[[nn.Module, nn.Module], nn.Module]
    same_arithmetic: Callable[[nn.Module, nn.Module], nn.Module] | None = None


CASES = {
    "cached-gist": Case(
        lambda model, guide: losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=MINI_BATCH),
        lambda model, guide: upstream.GISTEmbedLoss(model, guide),
        lambda model, guide: losses.GISTEmbedLoss(model, guide),
    ),
    "matryoshka-cmnrl": Case(
        lambda model, guide: losses.MatryoshkaLoss(
            model, upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH), DIMS
        ),
        lambda model, guide: upstream.MatryoshkaLoss(model, upstream.MultipleNegativesRankingLoss(model), DIMS),
    ),
    "matryoshka-cached-gist": Case(
        lambda model, guide: losses.MatryoshkaLoss(
            model, losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=MINI_BATCH), DIMS, [1.0, 0.5, 0.25]
        ),
        lambda model, guide: upstream.MatryoshkaLoss(
            model, upstream.GISTEmbedLoss(model, guide), DIMS, [1.0, 0.5, 0.25]
        ),
        lambda model, guide: losses.MatryoshkaLoss(model, losses.GISTEmbedLoss(model, guide), DIMS, [1.0, 0.5, 0.25]),
    ),
    "memory-cmnrl": Case(
        lambda model, guide: losses.CrossBatchMemoryLoss(
            model, upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH), memory_size=64
        ),
        lambda model, guide: losses.CrossBatchMemoryLoss(
            model, upstream.MultipleNegativesRankingLoss(model), memory_size=64
        ),
    ),
}
# Uneven mini-batches by token count: the ranges differ from batch to batch.
TOKEN_BUDGET = Case(
    lambda model, guide: losses.CachedGISTEmbedLoss(
        model, guide, mini_batch_size=MINI_BATCH, mini_batch_num_tokens=24
    ),
    lambda model, guide: upstream.GISTEmbedLoss(model, guide),
)
ALL_CASES = {**CASES, "cached-gist-token-budget": TOKEN_BUDGET}


def cases(names=None, table=CASES):
    return [pytest.param(table[name], id=name) for name in (names or table)]


def parameter_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def step(model, loss, columns, *, train: bool, backward=lambda value: value.backward(), seed: int = 1):
    """(value, gradients) of one forward and ``backward(value)`` from a fixed RNG state."""
    model.zero_grad(set_to_none=True)
    model.train(train)
    features = features_of(model, columns)
    torch.manual_seed(seed)
    with separate_column_forwards():
        value = loss(features, None)
    backward(value)
    grads = parameter_grads(model)
    model.zero_grad(set_to_none=True)
    return value.detach(), grads


def relative_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """``|actual - expected| / |expected|`` over all gradients together, as one vector."""
    difference = sum(((actual[name] - grad) ** 2).sum() for name, grad in expected.items())
    return float((difference / sum((grad**2).sum() for grad in expected.values())).sqrt())


# --------------------------------------------------------------------------------------------
# 1. bf16 autocast


@pytest.fixture
def bf16_model(tiny_bert_dir):
    """The tiny model with a Dense layer on top, in eval mode (no dropout).

    BERT ends in a LayerNorm, which autocast runs in fp32: without the Dense layer the embeddings would
    be fp32 and a test of reduced precision would pass without exercising it. The Linear runs in bf16,
    so the cached embeddings and their gradients are bf16 while the parameters stay fp32.
    """
    model = sentence_transformer_from(tiny_bert_dir)
    torch.manual_seed(0)
    model.append(st_modules().Dense(32, 32, activation_function=nn.Tanh()))
    return model.eval()


def in_autocast(model, loss, columns, *, enabled: bool = True, backward_inside: bool = False):
    """(value, gradients) of one step with the forward pass under bf16 autocast, and the backward
    after leaving it (as the trainer does) or inside it."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)
    model.zero_grad(set_to_none=True)
    features = features_of(model, columns)
    with autocast, separate_column_forwards():
        value = loss(features, None)
        if backward_inside:
            value.backward()
    if not backward_inside:
        value.backward()
    grads = parameter_grads(model)
    model.zero_grad(set_to_none=True)
    return value.detach().float(), grads


@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward-after-autocast", "backward-inside"])
@pytest.mark.parametrize("case", cases())
def test_bf16_autocast_matches_the_non_cached_loss(bf16_model, guide, case, backward_inside):
    """Under ``torch.autocast("cpu", bfloat16)`` the cached loss's value and gradients are the non-cached
    loss's up to bf16 rounding, and land finite, in fp32, on the fp32 parameters.

    A trainer computes the loss inside autocast and calls backward after leaving it, so the replay
    re-embeds in fp32 while the cached gradients came from bf16 embeddings; a user may also call
    backward inside the context. How far bf16 moves a result depends on the CPU's bf16 kernels and, with
    GIST's temperature of 0.01, is a few percent of the gradient; so the tolerance is measured: the
    cached loss must be about as close to the non-cached loss as the non-cached loss under bf16 is to
    itself in fp32. A lost, doubled or mis-cast gradient is off by 50% or more. The non-cached loss is
    the one with the same arithmetic (st_ext's ``GISTEmbedLoss`` for GIST, see the test after this one).
    """
    model = bf16_model
    columns = text_columns(BATCH, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        embeddings = model(features_of(model, columns[:1])[0])["sentence_embedding"]
    assert embeddings.dtype == torch.bfloat16, "the premise: bf16 embeddings under autocast"

    reference = case.same_arithmetic or case.reference
    cached_value, cached_grads = in_autocast(
        model, case.cached(model, guide), columns, backward_inside=backward_inside
    )
    reference_value, reference_grads = in_autocast(model, reference(model, guide), columns)
    fp32_value, fp32_grads = in_autocast(model, reference(model, guide), columns, enabled=False)

    bf16_noise = relative_error(reference_grads, fp32_grads)
    assert 0 < bf16_noise < 0.25, "the premise: bf16 changes the gradients, and not beyond recognition"
    error = relative_error(cached_grads, reference_grads)
    assert error <= 1.5 * bf16_noise + 0.01, (error, bf16_noise)
    value_noise = (reference_value - fp32_value).abs()
    assert (cached_value - reference_value).abs() <= 2 * value_noise + 0.02 * fp32_value.abs(), (
        cached_value,
        reference_value,
        fp32_value,
    )

    assert cached_grads.keys() == reference_grads.keys()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for name, grad in cached_grads.items():
        assert grad.dtype == torch.float32, name
        assert torch.isfinite(grad).all(), name


@pytest.mark.parametrize("case", cases(["cached-gist", "matryoshka-cached-gist"]))
def test_gist_under_bf16_is_as_accurate_as_upstream(bf16_model, guide, case):
    """Under bf16 autocast, cached GIST's gradients are as close to their fp32 values as upstream's
    non-cached GIST's are to theirs.

    The embeddings are bf16 either way; what a loss adds is the precision of its similarities, which
    the temperature then multiplies (1/0.05 here) into the logits. Upstream's similarities stay in fp32.
    """
    model = bf16_model
    columns = text_columns(BATCH, 3)

    def with_temperature(make_loss):
        loss = make_loss(model, guide)
        for module in loss.modules():
            if hasattr(module, "temperature"):
                module.temperature = 0.05
        return loss

    _, fp32_grads = in_autocast(model, with_temperature(case.reference), columns, enabled=False)
    _, upstream_grads = in_autocast(model, with_temperature(case.reference), columns)
    _, cached_grads = in_autocast(model, with_temperature(case.cached), columns)
    cached_error, upstream_error = relative_error(cached_grads, fp32_grads), relative_error(upstream_grads, fp32_grads)
    assert cached_error <= 1.25 * upstream_error, (cached_error, upstream_error)


# --------------------------------------------------------------------------------------------
# 2. Scaling by the outer backward


@pytest.mark.parametrize("case", cases())
def test_scaled_loss_scales_every_gradient(model, guide, case):
    """The gradient the outer backward hands the loss (gradient accumulation's 1/n, fp16 loss scaling)
    reaches every mini-batch.

    Scaling by a power of two is exact in floating point and every backward op is linear in its
    incoming gradient, so ``(loss * 0.25).backward()`` must give exactly a quarter of every gradient;
    any other factor agrees to round-off. Dropout is on, from the same seed in every run.
    """
    columns = text_columns(BATCH, 3)
    base_value, base = step(model, case.cached(model, guide), columns, train=True)
    assert base and any(grad.abs().max() > 0 for grad in base.values())

    quarter_value, quarter = step(
        model, case.cached(model, guide), columns, train=True, backward=lambda value: (value * 0.25).backward()
    )
    assert torch.equal(quarter_value, base_value)
    assert quarter.keys() == base.keys()
    for name, grad in base.items():
        assert torch.equal(quarter[name], grad * 0.25), name

    _, tripled = step(
        model,
        case.cached(model, guide),
        columns,
        train=True,
        backward=lambda value: torch.autograd.backward(value, torch.tensor(3.0)),  # grad_output given directly
    )
    assert_same_grads((base_value, tripled), (base_value, {name: grad * 3 for name, grad in base.items()}))


@pytest.fixture(scope="module")
def no_dropout_dir(tmp_path_factory):
    """The tiny BERT without dropout, so that cached and non-cached trainer runs see the same network."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert_no_dropout"), dropout=0.0)


@pytest.mark.parametrize("case", cases(["cached-gist", "matryoshka-cmnrl"]))
def test_gradient_accumulation_in_the_trainer_matches_the_non_cached_loss(no_dropout_dir, guide, tmp_path, case):
    """One optimizer step over two accumulated batches of 4 moves the weights as the non-cached loss does.

    The trainer divides each batch's loss by the number of accumulation steps before ``backward``; the
    cached gradient must be divided too, and the two batches' gradients must add up. Plain SGD without
    gradient clipping: Adam's first step is nearly the sign of the gradient, and clipping fixes its norm,
    so either would hide a wrong scale.
    """
    dataset = pair_dataset(16, negatives=1)

    def update(make_loss) -> list[torch.Tensor]:
        model = sentence_transformer_from(no_dropout_dir)
        before = [p.detach().clone() for p in model.parameters()]
        args = sentence_transformers.SentenceTransformerTrainingArguments(
            output_dir=str(tmp_path / "out"),
            max_steps=1,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            optim="sgd",
            learning_rate=0.1,
            max_grad_norm=0.0,  # clipping to a fixed norm would hide a wrong scale too
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            seed=0,
        )
        st_ext.SentenceTransformerTrainer(
            model=model, args=args, train_dataset=dataset, loss=make_loss(model, guide)
        ).train()
        return [after.detach() - old for after, old in zip(model.parameters(), before)]

    cached, reference = update(case.cached), update(case.reference)
    scale = max(delta.abs().max().item() for delta in reference)
    assert scale > 0, "the premise: the step moved the weights"
    for actual, expected in zip(cached, reference):
        torch.testing.assert_close(actual, expected, rtol=1e-3, atol=1e-4 * scale)


# --------------------------------------------------------------------------------------------
# 3. Nothing of a step outlives its loss tensor


def live_tensors() -> dict[int, weakref.ref]:
    """Every tensor the garbage collector tracks (``type``, not ``isinstance``: a dead weak proxy raises)."""
    return {id(obj): weakref.ref(obj) for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)}


@pytest.mark.parametrize("case", cases())
def test_backward_releases_everything_the_step_held(model, guide, case):
    """After ``backward()`` and dropping the loss tensor, no tensor of the step is alive: not the batch's
    features, not the cached embeddings or their gradients, not the RNG states.

    The backward hook holds the step's state; a trainer keeps only ``loss.detach()``. If the state were
    kept anywhere else (on the loss module, in a closure held by the model), every step would pin a
    batch's worth of embeddings and features. A cross-batch memory keeps its queue on purpose, and
    nothing else.
    """
    loss = case.cached(model, guide)
    columns = text_columns(BATCH, 3)
    model.train()
    loss(features_of(model, columns), None).backward()  # lazily built caches, if any, exist from here on
    model.zero_grad(set_to_none=True)
    gc.collect()

    features = features_of(model, columns)
    feature_refs = [weakref.ref(value) for column in features for value in column.values() if torch.is_tensor(value)]
    before = live_tensors()
    value = loss(features, None)
    created = {key: ref for key, ref in live_tensors().items() if key not in before}
    queue = (getattr(loss, "memory_embeddings", None), getattr(loss, "memory_labels", None))
    kept_on_purpose = {id(tensor) for tensor in queue if tensor is not None}
    held = {key: ref for key, ref in created.items() if key not in kept_on_purpose and ref() is not value}
    assert len(held) >= len(columns), "the premise: before backward, the step holds its cached gradients"

    value.backward()
    detached = value.detach()
    del features, value
    gc.collect()
    alive = [ref() for ref in (*held.values(), *feature_refs) if ref() is not None]
    assert not alive, [(tuple(t.shape), t.dtype) for t in alive]
    assert torch.isfinite(detached)


# --------------------------------------------------------------------------------------------
# 4. Two forward passes before one backward


@pytest.mark.parametrize("case", cases(table=ALL_CASES))
def test_two_forwards_before_one_backward(model, guide, case):
    """``(loss(f1) + loss(f2)).backward()`` gives the gradients of ``loss(f1).backward()`` followed by
    ``loss(f2).backward()``: each forward pass's features, mini-batch ranges, RNG states and cached
    gradients travel with its own loss tensor.

    The batches differ in size (8 and 6 rows), so they split into different mini-batches; dropout is on,
    so the first pass's replay must use its own random states, not the second's. The reference runs the
    same passes in the same order from the same seed; a backward leaves the outer RNG where it was, so
    both orders draw the same masks. A cross-batch memory sees the first batch's documents in the second
    pass either way.
    """
    first, second = text_columns(BATCH, 3, seed=1), text_columns(6, 3, seed=2)
    model.train()

    reference = case.cached(model, guide)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    expected_values = []
    for columns in (first, second):
        value = reference(features_of(model, columns), None)
        value.backward()
        expected_values.append(value.detach())
    expected = parameter_grads(model)

    shared = case.cached(model, guide)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    value_first = shared(features_of(model, first), None)
    value_second = shared(features_of(model, second), None)
    (value_first + value_second).backward()
    actual = parameter_grads(model)

    torch.testing.assert_close(value_first.detach(), expected_values[0])
    torch.testing.assert_close(value_second.detach(), expected_values[1])
    assert_same_grads((torch.tensor(0.0), actual), (torch.tensor(0.0), expected))


# --------------------------------------------------------------------------------------------
# 5. A compiled model


def use_model(loss: nn.Module, replacement: nn.Module) -> nn.Module:
    """Put ``replacement`` in place of every loss's ``model``, as the trainer does with a wrapped model."""
    for name, child in list(loss.named_children()):
        if name == "model" and isinstance(child, sentence_transformers.SentenceTransformer):
            setattr(loss, name, replacement)
        elif isinstance(child, nn.Module) and not isinstance(child, sentence_transformers.SentenceTransformer):
            use_model(child, replacement)
    return loss


def test_compiled_model_gives_the_uncompiled_gradients(model, guide):
    """With ``torch.compile(model)`` every cached loss gives the uncompiled value and gradients, dropout on.

    The compiled graphs must run both without grad (step 1) and with grad inside ``backward()`` (the
    replay), and replaying the RNG state must reproduce the compiled graph's dropout masks. Backend
    ``aot_eager``: it traces with Dynamo and builds the backward with AOTAutograd as inductor does,
    without generating and compiling C++, which takes over a minute for these graphs on a 2-core CPU.
    """
    import torch._dynamo

    calls: list[bool] = []
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def counting_backend(graph_module, example_inputs):
        compiled_graph = aot_eager(graph_module, example_inputs)

        def run(*args):
            calls.append(torch.is_grad_enabled())
            return compiled_graph(*args)

        return run

    torch._dynamo.reset()
    # dynamic=True: every mini-batch has its own padded width, and one shape-generic graph per grad mode
    # compiles in 10 s of CPU instead of several specialised ones.
    compiled = torch.compile(model, backend=counting_backend, dynamic=True)
    columns = text_columns(BATCH, 3)
    try:
        for name, case in CASES.items():
            calls.clear()
            expected = loss_and_grads(model, case.cached(model, guide), columns, train=True)
            actual = loss_and_grads(model, use_model(case.cached(model, guide), compiled), columns, train=True)
            assert False in calls and True in calls, f"{name}: the compiled model ran in both passes"
            assert_same_grads(actual, expected)
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
def test_trainer_torch_compile_trains_like_uncompiled(tiny_bert_dir, guide, tmp_path):
    """The trainer's ``torch_compile`` path (the model compiled by the trainer, swapped into the losses)
    with Matryoshka over cached GIST: one step moves the weights exactly as without compiling.

    ``aot_eager`` for the reason given above; tracing the tiny BERT for the trainer still takes 15-30 s
    on a 2-core CPU.
    """
    import torch._dynamo

    dataset = pair_dataset(8, negatives=1)

    def train(torch_compile: bool):
        model = sentence_transformer_from(tiny_bert_dir)
        loss = CASES["matryoshka-cached-gist"].cached(model, guide)
        seen = []
        loss.register_forward_pre_hook(lambda module, args: seen.append((type(module.model), type(module.loss.model))))
        args = sentence_transformers.SentenceTransformerTrainingArguments(
            output_dir=str(tmp_path / f"out-{torch_compile}"),
            max_steps=1,
            per_device_train_batch_size=8,
            optim="sgd",
            learning_rate=0.1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            seed=0,
            torch_compile=torch_compile,
            **({"torch_compile_backend": "aot_eager"} if torch_compile else {}),
        )
        st_ext.SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss).train()
        return [p.detach().clone() for p in model.parameters()], seen

    torch._dynamo.reset()
    try:
        eager_weights, _ = train(False)
        compiled_weights, seen = train(True)
    finally:
        torch._dynamo.reset()
    assert seen and all(outer is inner and "OptimizedModule" in outer.__name__ for outer, inner in seen)
    for compiled, eager in zip(compiled_weights, eager_weights):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------------
# 6. RNG replay


def on(device: str, features: list[dict]) -> list[dict]:
    return [{key: value.to(device) if torch.is_tensor(value) else value for key, value in f.items()} for f in features]


def rng_states(device: str) -> list[torch.Tensor]:
    return [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device == "cuda" else [])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("case", cases(table=ALL_CASES))
def test_replay_re_embeds_every_mini_batch_bit_for_bit_with_dropout(model, guide, case, device):
    """With dropout on and several mini-batches per column, the replay inside ``backward()`` re-embeds each
    mini-batch exactly as the first pass did, and leaves the outer RNG as it found it.

    The cached gradients belong to the first pass's embeddings; any other dropout mask in the replay
    would apply them to different embeddings. (Dropout with a single mini-batch per column is compared
    with the non-cached loss in test_cached_matryoshka.py and test_cached_gist.py.)
    """
    model.to(device)
    guide.to(device)
    first_pass, replay = [], []
    model.register_forward_hook(
        lambda module, args, output: (replay if torch.is_grad_enabled() else first_pass).append(
            output["sentence_embedding"].detach().clone()
        )
    )
    loss = case.cached(model, guide)
    columns = text_columns(BATCH, 3, max_words=18)
    model.train()
    torch.manual_seed(0)
    value = loss(on(device, features_of(model, columns)), None)
    torch.manual_seed(1234)  # elsewhere than where the first pass left it, which a replay would also reach
    outer = rng_states(device)
    value.backward()

    assert all(torch.equal(*states) for states in zip(rng_states(device), outer)), "the replay moved the outer RNG"
    assert len(first_pass) == len(replay) > len(columns), "several mini-batches per column"
    for index, (embedded, replayed) in enumerate(zip(first_pass, replay)):
        assert torch.equal(embedded, replayed), f"mini-batch {index} was re-embedded differently"
    # The premise: embedding a mini-batch again from another RNG state gives other embeddings.
    anchors = on(device, features_of(model, columns))[0]
    minibatch = slice_rows(anchors, 0, 2, layout_of(anchors))
    with torch.no_grad():
        again = [model(dict(minibatch))["sentence_embedding"] for _ in "ab"]
    assert not torch.equal(*again)


class FakeAccelerator:
    """A stand-in for an accelerator's random generators, so the replay can be checked on a CPU machine.

    ``kind="mps"``: one generator and no per-device context, as ``torch.mps`` has. ``kind="xpu"``: one
    generator per device index, reached through ``torch.xpu.device(index)``, as CUDA-like backends have.
    Tensors that report the device are CPU tensors of :meth:`tensor`'s subclass.
    """

    def __init__(self, kind: str, seed: int = 0) -> None:
        self.kind = kind
        self.generators = {0: torch.Generator().manual_seed(seed)}
        self.current = 0
        device = torch.device(kind) if kind == "mps" else torch.device(kind, 0)

        class OnDevice(torch.Tensor):
            @property
            def device(self):
                return device

            def get_device(self):
                return device.index if device.index is not None else -1

        self.tensor_type = OnDevice

    @property
    def generator(self) -> torch.Generator:
        """The generator random ops on this accelerator draw from (the current device's)."""
        return self.generators[self.current]

    def tensor(self, data: torch.Tensor) -> torch.Tensor:
        return data.as_subclass(self.tensor_type)

    def get_rng_state(self, device=None) -> torch.Tensor:
        return self.generators[self._index(device)].get_state()

    def set_rng_state(self, state: torch.Tensor, device=None) -> None:
        self.generators[self._index(device)].set_state(state)

    def _index(self, device) -> int:
        if device is None or isinstance(device, str):
            return self.current
        return device.index if isinstance(device, torch.device) else int(device)

    @contextlib.contextmanager
    def device(self, index):
        previous, self.current = self.current, int(index)
        try:
            yield
        finally:
            self.current = previous

    def install(self, monkeypatch) -> None:
        module = getattr(torch, self.kind)
        monkeypatch.setattr(module, "get_rng_state", self.get_rng_state)
        monkeypatch.setattr(module, "set_rng_state", self.set_rng_state)
        if self.kind != "mps":
            monkeypatch.setattr(module, "device", self.device)
            monkeypatch.setattr(module, "device_count", lambda: 1)


class NoisyEncoder(nn.Module):
    """A linear encoder with dropout drawn from the accelerator's generator, as on a real device."""

    def __init__(self, accelerator: FakeAccelerator) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(6, 4)
        self.accelerator = accelerator

    def forward(self, features):
        x = features["x"].as_subclass(torch.Tensor)
        keep = torch.rand(x.shape, generator=self.accelerator.generator) > 0.5
        return {"sentence_embedding": self.linear(x * keep * 2.0)}


def coupled_loss(model: nn.Module) -> CachedLoss:
    """The smallest cached loss: every row's gradient depends on every other row, as in contrastive losses."""

    def loss_fn(reps, labels, *, with_backward):
        value = of_embeddings([torch.cat(column) for column in reps])
        if with_backward:
            value.backward()
            value = value.detach()
        return value

    return CachedLoss("CoupledLoss", model, lambda features, ranges, size: LossStep(lambda source: loss_fn), 2)


def of_embeddings(columns: list[torch.Tensor]) -> torch.Tensor:
    return (columns[0] @ columns[1].T).logsumexp(dim=1).sum() + (columns[0].sum(0) ** 2).sum()


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("mps", id="single-generator-mps"),
        pytest.param("xpu", id="per-device-xpu"),
    ],
)
def test_replay_restores_the_generator_of_a_device_other_than_cpu_and_cuda(monkeypatch, kind):
    """Dropout drawn from an accelerator's own generator is replayed, and the outer state is restored.

    MPS has one generator and no ``torch.mps.device``, so torch.utils.checkpoint's device-state helpers
    cannot save it; other backends (XPU, HPU, out-of-tree devices) keep one generator per device, like
    CUDA, but in their own module. The accelerator here is simulated: its tensors are CPU tensors that
    report its device, and its generator functions are patched into ``torch.<kind>``. The cached
    gradients must equal those of embedding the same mini-batches, in the same order, with a graph.
    """
    accelerator = FakeAccelerator(kind)
    accelerator.install(monkeypatch)
    model = NoisyEncoder(accelerator)
    generator = torch.Generator().manual_seed(1)
    columns = [torch.randn(5, 6, generator=generator) for _ in range(2)]

    def features():
        return [{"x": accelerator.tensor(column.clone())} for column in columns]

    accelerator.generator.manual_seed(7)
    model.zero_grad(set_to_none=True)
    embedded = [
        torch.cat([model({"x": column[begin : begin + 2]})["sentence_embedding"] for begin in range(0, 5, 2)])
        for column in columns
    ]
    expected_value = of_embeddings(embedded)
    expected_value.backward()
    expected = parameter_grads(model)

    accelerator.generator.manual_seed(7)
    model.zero_grad(set_to_none=True)
    value = gradcache_forward(coupled_loss(model), features(), None)
    accelerator.generator.manual_seed(99)  # not where the first pass left it, which a replay would also reach
    outer = accelerator.get_rng_state()
    value.backward()
    actual = parameter_grads(model)

    assert torch.equal(accelerator.get_rng_state(), outer), "the replay left the accelerator's generator moved"
    torch.testing.assert_close(value.detach(), expected_value.detach())
    assert_same_grads((value.detach(), actual), (expected_value.detach(), expected))


@pytest.fixture
def deepspeed_imported(monkeypatch):
    """The process has imported DeepSpeed (transformers imports it when it saves a model, wherever it is
    installed); its gradient flags are recorded, not set."""
    monkeypatch.setitem(sys.modules, "deepspeed", sys.modules.get("deepspeed") or types.ModuleType("deepspeed"))
    marked = []

    def record(parameters, ready):
        marked.append((len(list(parameters)), ready))
        return contextlib.nullcontext()

    monkeypatch.setattr(_compat, "deepspeed_gradients_ready", record)
    return marked


def test_a_process_that_only_imported_deepspeed_marks_no_parameter(deepspeed_imported):
    assert not torch.distributed.is_initialized()
    with gradient_sync(nn.Linear(2, 2), sync=False):
        pass
    assert deepspeed_imported == []


def test_under_a_process_group_deepspeed_gradients_are_held(deepspeed_imported, tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with gradient_sync(nn.Linear(2, 2), sync=False):
            pass
    finally:
        torch.distributed.destroy_process_group()
    assert deepspeed_imported == [(2, False)]
