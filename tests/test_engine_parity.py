"""st_ext's GradCache engine against upstream's, change by change, up to sentence-transformers 6.2.

Upstream's cached losses share one engine since 5.7 (``sentence_transformers/base/losses/gradcache.py``,
PR #3862); 6.0 and 6.2 changed it further. Each test here takes one of those changes, runs st_ext on
the same inputs as upstream's own cached loss (or its uncached loss, where the cached one is not
comparable), and shows st_ext does the same or better; where the installed upstream release predates
the change, the test says what that release does instead.

The DDP tests share one launch of ``tests/distributed_worker.py engine-parity`` on 2 gloo ranks
(:func:`ddp_parity`): a cached step under DDP by st_ext, by upstream's cached loss and by the uncached
loss, with each step's all-reductions counted; the same under ``static_graph=True``; and a step whose
final mini-batch no backward runs through.
"""

from __future__ import annotations

import contextlib
import inspect

import distributed_worker as worker
import pytest
import torch
import torch.distributed as dist
from datasets import Dataset
from loss_checks import features_of, text_columns
from packaging.version import Version
from test_cached_mechanics import FakeAccelerator
from test_distributed import torchrun
from tiny_models import build_tokenizer, save_tiny_bert, sentence_transformer_from
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import st_ext
from st_ext import _compat, losses
from st_ext._compat import ST_VERSION, st_losses, st_modules
from st_ext.gradient_sync import gradient_sync
from st_ext.losses.gradcache import CachedLoss, LossStep, RngState, described

try:  # 5.7+: one engine for every cached loss
    from sentence_transformers.base.losses import gradcache as upstream_engine
except ImportError:
    upstream_engine = None

#: The 6.2 engine: DDP's reduction held until a cached step's last mini-batch (PR #4039, issue #4027) and
#: the replay changes that came with it (frozen final mini-batch, the torch < 2.4 refusal, float64 kept).
UPSTREAM_HOLDS_DDP_SYNC = hasattr(upstream_engine, "_ddp_replay_context")
#: Upstream's cached losses take a token budget (PR #3862, 5.7).
UPSTREAM_HAS_TOKEN_BUDGET = (
    "mini_batch_num_tokens" in inspect.signature(st_losses().CachedMultipleNegativesRankingLoss.__init__).parameters
)


def upstream_rand_context() -> type:
    """Upstream's RNG snapshot class: in the shared engine from 5.7, in the cached loss's module before."""
    if upstream_engine is not None:
        return upstream_engine.RandContext
    import importlib

    return importlib.import_module(st_losses().CachedMultipleNegativesRankingLoss.__module__).RandContext


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def step_grads(model: nn.Module, loss: nn.Module, features: list[dict], *, autocast: bool = False):
    """The loss value and gradients of one forward (under bf16 autocast if asked, as the Trainer runs it)
    and one backward outside it."""
    model.zero_grad(set_to_none=True)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        value = loss([dict(f) for f in features], None)
    value.backward()
    grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    return value.detach().double(), grads


def assert_grads_close(actual: dict, expected: dict, rtol: float, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    scale = max(grad.abs().max().item() for grad in expected.values())
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, rtol=rtol, atol=rtol * scale, msg=f"{what}: {name}")


def max_relative_error(actual: dict, expected: dict) -> float:
    scale = max(grad.abs().max().item() for grad in expected.values())
    return max((actual[name] - grad).abs().max().item() for name, grad in expected.items()) / scale


@contextlib.contextmanager
def single_rank_group():
    """A gloo process group of this process alone, so DDP can wrap a model here; destroyed afterwards
    (other tests read ``dist.is_initialized()``)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def held_inside(ddp: DistributedDataParallel, context) -> bool:
    """Whether a backward inside ``context`` would skip DDP's reduction."""
    with context:
        return not ddp.require_backward_grad_sync


# ---------------------------------------------------------------------------------------------
# DDP, 2 ranks: (a) reduce once per step, (b) a frozen final mini-batch, (h) static_graph


@pytest.fixture(scope="module")
def ddp_parity(tmp_path_factory) -> list[dict]:
    """Both ranks' records of every ``engine-parity`` scenario (see ``distributed_worker.run_engine_parity``)."""
    out = tmp_path_factory.mktemp("engine_parity")
    model_dir = save_tiny_bert(out / "model", dropout=0.0)
    torchrun("engine-parity", "--model", str(model_dir), "--out", str(out), log=out / "torchrun.log")
    return [torch.load(out / f"parity-rank{rank}.pt") for rank in range(worker.WORLD_SIZE)]


def scenario(ranks: list[dict], name: str, kind: str, step: int) -> list[dict]:
    records = [rank[name][kind] for rank in ranks]
    assert all(len(steps) > step for steps in records), f"{name}/{kind}: fewer steps than expected"
    return [steps[step] for steps in records]


def assert_same_ddp_step(records: list[dict], reference: dict, what: str) -> None:
    """Every rank holds the reference's averaged gradients and updated parameters."""
    for rank, record in enumerate(records):
        assert "error" not in record, f"{what}, rank {rank}: {record.get('error')}"
        assert_grads_close(record["grads"], reference["grads"], 1e-4, f"{what}, rank {rank} gradients")
        assert_grads_close(record["params"], reference["params"], 1e-5, f"{what}, rank {rank} parameters")


@pytest.mark.distributed
def test_ddp_reduces_once_per_cached_step_like_the_uncached_loss(ddp_parity):
    """Upstream PR #4039 (issue #4027, 6.2, ``base/losses/gradcache.py``): a cached step under DDP
    all-reduces once, as the uncached loss does, not once per mini-batch and column.

    st_ext holds every mini-batch but the last under ``no_sync`` (``gradient_sync``) on every release;
    upstream does the same from 6.2, and before reduces after every mini-batch (same gradients, more
    traffic). With partial caching the kept graphs' backward is held too (``st_ext_partial``). Each step:
    the number of gradient buckets DDP all-reduced, the gradients and the update, against the uncached
    loss under the same DDP.
    """
    for step in range(worker.PARITY_STEPS):
        plain = scenario(ddp_parity, "ddp", "plain", step)
        ours = scenario(ddp_parity, "ddp", "st_ext", step)
        partial = scenario(ddp_parity, "ddp", "st_ext_partial", step)
        theirs = scenario(ddp_parity, "ddp", "upstream", step)
        one_round = plain[0]["reductions"]
        assert one_round >= 1
        assert_same_ddp_step(ours, plain[0], f"st_ext, step {step}")
        assert_same_ddp_step(partial, plain[0], f"st_ext with kept graphs, step {step}")
        assert_same_ddp_step(theirs, plain[0], f"upstream, step {step}")
        assert [record["reductions"] for record in ours] == [one_round] * worker.WORLD_SIZE
        assert [record["reductions"] for record in partial] == [one_round] * worker.WORLD_SIZE
        if UPSTREAM_HOLDS_DDP_SYNC:
            assert [record["reductions"] for record in theirs] == [one_round] * worker.WORLD_SIZE
        else:
            assert theirs[0]["reductions"] > one_round, "premise: this upstream reduces every mini-batch"


@pytest.mark.distributed
def test_ddp_static_graph_reduces_its_first_mini_batch_and_then_once_per_step(ddp_parity):
    """Upstream 6.2 (``_ddp_replay_context``, with PR #4039): static-graph DDP learns its graph in the first
    iteration and must reduce in that iteration's first backward, even inside ``no_sync``; holding it
    fails DDP's internal assertion ``expect_autograd_hooks_``. st_ext forces that one reduction too
    (``gradient_sync``): the first step reduces twice, later ones once, with the uncached loss's
    gradients and updates, as upstream 6.2 does. Upstream before 6.2 reduces every mini-batch."""
    for step in range(worker.PARITY_STEPS):
        plain = scenario(ddp_parity, "static_graph", "plain", step)
        theirs = scenario(ddp_parity, "static_graph", "upstream", step)
        one_round = plain[0]["reductions"]
        assert_same_ddp_step(theirs, plain[0], f"upstream, step {step}")
        expected = 2 * one_round if step == 0 else one_round
        for kind in ("st_ext", "st_ext_partial"):  # with kept graphs, their backward is the first
            ours = scenario(ddp_parity, "static_graph", kind, step)
            assert_same_ddp_step(ours, plain[0], f"{kind}, step {step}")
            assert [record["reductions"] for record in ours] == [expected] * worker.WORLD_SIZE
        if UPSTREAM_HOLDS_DDP_SYNC:
            assert [record["reductions"] for record in theirs] == [expected] * worker.WORLD_SIZE


class UpstreamPremiseError(RuntimeError):
    """What upstream does differs from what the test was written against (not st_ext's gap)."""


@pytest.mark.distributed
def test_ddp_reduces_when_the_final_mini_batch_is_frozen(ddp_parity):
    """Upstream 6.2 (with PR #4039, ``_backward_hook``): when the step's last mini-batch is frozen (its
    embeddings carry no graph, as through a frozen Router route), the held gradients must still be
    reduced: upstream replays the last trainable mini-batch with zero embedding gradients under sync
    (and skips the buffer broadcast of that extra forward). Upstream before 6.2 fails the step (4.1:
    the frozen mini-batch's surrogate has no graph to back-propagate).

    The reference: the uncached loss's gradients averaged over both ranks' shares, in one process.
    """
    reference = ddp_parity[0]["frozen_last"]["reference"][0]
    theirs = scenario(ddp_parity, "frozen_last", "upstream", 0)
    if UPSTREAM_HOLDS_DDP_SYNC:
        try:
            assert_same_ddp_step(theirs, reference, "upstream")
        except AssertionError as error:
            raise UpstreamPremiseError(str(error)) from None
    elif not all("error" in record for record in theirs):
        raise UpstreamPremiseError("expected this upstream release to fail on a frozen final mini-batch")
    for kind in ("st_ext", "st_ext_partial"):  # with kept graphs: the frozen column's two are replayed
        assert_same_ddp_step(scenario(ddp_parity, "frozen_last", kind, 0), reference, kind)


# ---------------------------------------------------------------------------------------------
# (c) find_unused_parameters=True before torch 2.4


def test_unused_parameter_detection_before_torch_2_4_reduces_every_mini_batch(model, monkeypatch):
    """Upstream 6.2 (with PR #4039): cached losses under DDP with ``find_unused_parameters=True`` raise on
    torch < 2.4, whose ``no_sync`` forgot the parameters a held backward used (pytorch PR #124193), so
    holding would leave some gradients unreduced. st_ext works instead: there it reduces every mini-batch
    (correct, as before #4039), and holds as usual on torch >= 2.4 or without unused-parameter detection.

    torch < 2.4 cannot be installed next to this release, so the decision is checked by its switch
    (``_compat.DDP_NO_SYNC_TRACKS_UNUSED_PARAMETERS``, set from the torch version) and by counting the reductions of
    a real cached step under a one-rank DDP. Upstream's refusal is checked under a patched torch version.
    """
    assert _compat.DDP_NO_SYNC_TRACKS_UNUSED_PARAMETERS == (Version(torch.__version__).release >= (2, 4))
    columns = text_columns(8, 2)
    features = features_of(model, columns)
    with single_rank_group():
        detecting = DistributedDataParallel(model, find_unused_parameters=True)
        assert held_inside(detecting, gradient_sync(detecting, sync=False))
        reductions = worker.counted_reductions(detecting)
        loss = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=4)
        worker.use_wrapped_model(loss, detecting)
        expected_value, expected = step_grads(model, loss, features)
        assert reductions[0] == 1

        monkeypatch.setattr(_compat, "DDP_NO_SYNC_TRACKS_UNUSED_PARAMETERS", False)
        assert not held_inside(detecting, gradient_sync(detecting, sync=False))
        reductions[0] = 0
        value, grads = step_grads(model, loss, features)
        assert reductions[0] == 4, "16 rows in mini-batches of 4: one reduction each"
        torch.testing.assert_close(value, expected_value)
        assert_grads_close(grads, expected, 1e-5, "reducing every mini-batch")
        not_detecting = DistributedDataParallel(model, find_unused_parameters=False)
        assert held_inside(not_detecting, gradient_sync(not_detecting, sync=False))

        if UPSTREAM_HOLDS_DDP_SYNC:
            theirs = st_losses().CachedMultipleNegativesRankingLoss(model, mini_batch_size=4)
            worker.use_wrapped_model(theirs, detecting)
            value = theirs([dict(f) for f in features], None)
            monkeypatch.setattr(torch, "__version__", "2.3.1")
            with pytest.raises(ValueError, match="find_unused_parameters=True require PyTorch >=2.4"):
                value.backward()
    model.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------
# (d) torch.compile


def test_a_compiled_model_is_looked_through(model, guide, tmp_path):
    """Upstream 6.2 looks through ``torch.compile``'s wrapper (``_orig_mod``) where the engine inspects the
    model: finding DDP in the backward hook, refusing a StaticEmbedding input (``has_static_embedding_input``),
    and, PR #4015, when the trainer prepares a cached loss for a compiled model (4.x-6.1 crashed there with
    "'OptimizedModule' object is not subscriptable"). st_ext: its trainer takes a compiled model with cached
    losses; ``gradient_sync`` holds DDP's reduction inside a compiled DDP (accelerate compiles the DDP
    module), as it does for a bare one; a compiled StaticEmbedding model is refused as upstream 6.2 does.
    Nothing is compiled: ``torch.compile`` wraps lazily, and only the wrapper's attributes matter here.
    """
    compiled = torch.compile(model, backend="eager")
    dataset = Dataset.from_dict(dict(zip(["anchor", "positive"], text_columns(4, 2))))
    for loss in (
        losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2),
        losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=2),
    ):
        trainer = st_ext.SentenceTransformerTrainer(
            model=compiled,
            args=st_ext.SentenceTransformerTrainingArguments(
                output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=4
            ),
            train_dataset=dataset,
            loss=loss,
        )
        assert trainer.loss is loss

    static = st_ext.SentenceTransformer(
        modules=[st_modules().StaticEmbedding(build_tokenizer().backend_tokenizer, embedding_dim=32)], device="cpu"
    )
    with pytest.raises(ValueError, match="StaticEmbedding"):
        losses.CachedGISTEmbedLoss(torch.compile(static, backend="eager"), guide)
    if upstream_engine is not None and hasattr(upstream_engine, "has_static_embedding_input"):
        assert upstream_engine.has_static_embedding_input(torch.compile(static, backend="eager"))

    with single_rank_group():
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        compiled_ddp = torch.compile(ddp, backend="eager")
        assert held_inside(ddp, gradient_sync(compiled_ddp, sync=False))
        assert not held_inside(ddp, gradient_sync(compiled_ddp, sync=True))


# ---------------------------------------------------------------------------------------------
# (e) precision of the replay


@pytest.fixture
def dense_model(tiny_bert_dir):
    """The tiny model with a Dense layer on top, dropout off: under bf16 autocast its embeddings are bf16
    (BERT's last LayerNorm runs in fp32, a Linear in bf16)."""
    model = sentence_transformer_from(tiny_bert_dir)
    torch.manual_seed(0)
    model.append(st_modules().Dense(32, 32, activation_function=nn.Tanh()))
    return model.eval()


def test_replay_keeps_double_precision_and_promotes_mixed_precision(dense_model):
    """Upstream 6.2 (``_backward_hook``): the replay's surrogate ``dot(embeddings, cached gradients)`` is
    computed in the promoted dtype of both, at least fp32: float64 stays float64 (5.7-6.1 cast to fp32),
    and bf16 cached gradients meet the fp32 embeddings a replay outside autocast produces (4.x raised
    "expected both vectors to have same dtype" there).

    float64: st_ext's cached gradients are the uncached loss's to float64 round-off, far below float32's
    (a surrogate in fp32 misses by about 1e-7). bf16 autocast, backward outside it as the Trainer runs:
    st_ext's are the uncached loss's up to bf16 rounding, as upstream 6.2's cached loss's are.
    """
    columns = text_columns(8, 2)
    uncached = st_losses().MultipleNegativesRankingLoss(dense_model)
    ours = losses.CachedMultipleNegativesRankingLoss(dense_model, mini_batch_size=3)
    theirs = st_losses().CachedMultipleNegativesRankingLoss(dense_model, mini_batch_size=3)

    dense_model.double()
    features = features_of(dense_model, columns)
    expected_value, expected = step_grads(dense_model, uncached, features)
    value, grads = step_grads(dense_model, ours, features)
    torch.testing.assert_close(value, expected_value, rtol=1e-12, atol=0)
    assert max_relative_error(grads, expected) < 1e-12
    assert all(grad.dtype == torch.float64 for grad in grads.values())
    if UPSTREAM_HOLDS_DDP_SYNC:  # the same 6.2 change
        assert max_relative_error(step_grads(dense_model, theirs, features)[1], expected) < 1e-12

    dense_model.float()
    expected_value, expected = step_grads(dense_model, uncached, features, autocast=True)
    value, grads = step_grads(dense_model, ours, features, autocast=True)
    torch.testing.assert_close(value, expected_value, rtol=2e-2, atol=0)
    assert all(grad.dtype == torch.float32 and grad.isfinite().all() for grad in grads.values())
    assert_grads_close(grads, expected, 5e-2, "bf16 autocast")
    if upstream_engine is not None:
        assert_grads_close(step_grads(dense_model, theirs, features, autocast=True)[1], expected, 5e-2, "upstream")


# ---------------------------------------------------------------------------------------------
# (f) token budgets


def test_token_budget_packs_rows_validates_and_errors_as_upstream(model, guide):
    """Upstream PR #3862 (5.7, ``_minibatch_ranges``, ``_validate_mini_batch_num_tokens``): with
    ``mini_batch_num_tokens`` a mini-batch takes rows greedily while their non-padding tokens fit the
    budget, a longer row goes alone; a budget <= 0 is refused at construction; features without token
    counts (no ``attention_mask``, not flattened) are refused at the first batch.

    st_ext: the same packing (each pass within the budget and ended early only at a column boundary, where
    columns that need different widths do not share a pass), the same refusals, gradients equal to the uncached loss and to
    upstream's cached loss under the same budget. st_ext's ``CachedGISTEmbedLoss`` takes the budget on
    every release; upstream before 5.7 has no token budget at all.
    """
    budget = 40
    for bad in (0, -8):
        with pytest.raises(ValueError, match="mini_batch_num_tokens"):
            losses.CachedGISTEmbedLoss(model, guide, mini_batch_num_tokens=bad)
        if UPSTREAM_HAS_TOKEN_BUDGET:
            with pytest.raises(ValueError, match="mini_batch_num_tokens"):
                st_losses().CachedGISTEmbedLoss(model, guide, mini_batch_num_tokens=bad)
            with pytest.raises(ValueError, match="mini_batch_num_tokens"):
                losses.CachedMultipleNegativesRankingLoss(model, mini_batch_num_tokens=bad)

    model.eval()
    columns = text_columns(12, 2, min_words=2, max_words=30)
    features = features_of(model, columns)
    lengths = [int(n) for f in features for n in f["attention_mask"].sum(dim=1)]
    assert max(lengths) > budget // 2, "premise: rows long enough to end mini-batches"
    passes: list[tuple[int, int]] = []  # (rows, non-padding tokens) of each first-pass forward

    def record_pass(module, args, output):
        if not torch.is_grad_enabled():
            passes.append((output["attention_mask"].shape[0], int(output["attention_mask"].sum())))

    model.register_forward_hook(record_pass)
    ours = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=64, mini_batch_num_tokens=budget)
    value, grads = step_grads(model, ours, features)
    assert sum(rows for rows, _ in passes) == len(lengths) and len(passes) > 2
    assert all(tokens <= budget or rows == 1 for rows, tokens in passes), passes
    # Greedy, in column order: a pass ends where the next row would not fit, or at a column boundary (a pass
    # that would span one is cut there where the columns need different widths: sharing it would cost padding).
    begin = 0
    for rows, tokens in passes[:-1]:
        start, begin = begin, begin + rows
        assert tokens == sum(lengths[start:begin])
        at_column_boundary = start % len(columns[0]) == 0 or begin % len(columns[0]) == 0
        assert tokens + lengths[begin] > budget or at_column_boundary, (passes, lengths)
    expected_value, expected = step_grads(model, st_losses().GISTEmbedLoss(model, guide), features)
    torch.testing.assert_close(value, expected_value, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, expected, 1e-4, "token budget vs uncached")
    if UPSTREAM_HAS_TOKEN_BUDGET:
        theirs = st_losses().CachedGISTEmbedLoss(model, guide, mini_batch_size=64, mini_batch_num_tokens=budget)
        assert_grads_close(step_grads(model, theirs, features)[1], expected, 1e-4, "upstream token budget")

    without_counts = [{key: value for key, value in f.items() if key != "attention_mask"} for f in features]
    with pytest.raises(ValueError, match="mini_batch_num_tokens"):
        ours([dict(f) for f in without_counts], None)
    if UPSTREAM_HAS_TOKEN_BUDGET:
        with pytest.raises(ValueError, match="mini_batch_num_tokens"):
            theirs([dict(f) for f in without_counts], None)


# ---------------------------------------------------------------------------------------------
# (g) RNG replay, MPS included


def test_rng_replay_of_a_single_generator_device_matches_upstream(monkeypatch):
    """Upstream PR #3812 (5.6, ``RandContext``): the dropout RNG is snapshotted per mini-batch and replayed,
    MPS included, whose single generator ``torch.utils.checkpoint``'s device-state helpers cannot save
    (they call the missing ``torch.mps.device``); the outer states come back after the replay.

    st_ext's ``RngState`` against upstream's ``RandContext`` on the same simulated MPS tensors (CPU tensors
    that report the MPS device; ``torch.mps``'s generator functions patched onto a CPU generator): both
    replay the CPU and MPS draws and restore both outer states; upstream before 5.6 fails on them.
    """
    accelerator = FakeAccelerator("mps")
    accelerator.install(monkeypatch)
    inputs = [accelerator.tensor(torch.zeros(2)), torch.zeros(2)]

    def draws() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(4, generator=accelerator.generator), torch.rand(4)

    def replayed(snapshot, enter) -> tuple[torch.Tensor, torch.Tensor]:
        accelerator.generator.manual_seed(7)
        torch.manual_seed(7)
        state = snapshot()
        first = draws()
        accelerator.generator.manual_seed(99)
        torch.manual_seed(99)
        outer = accelerator.get_rng_state(), torch.get_rng_state()
        with enter(state):
            again = draws()
        assert torch.equal(accelerator.get_rng_state(), outer[0]), "the MPS generator was left moved"
        assert torch.equal(torch.get_rng_state(), outer[1]), "the CPU generator was left moved"
        for before, after in zip(first, again):
            assert torch.equal(before, after), "the replay drew other numbers"
        return first

    ours = replayed(lambda: RngState(inputs), lambda state: state.replay())
    rand_context = upstream_rand_context()
    if ST_VERSION >= Version("5.6.0"):
        theirs = replayed(lambda: rand_context(*inputs), lambda state: state)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    else:
        with pytest.raises(AttributeError):
            rand_context(*inputs)


# ---------------------------------------------------------------------------------------------
# (h) other engine changes from 5.4 to 6.2


class IgnoresSecondColumn(nn.Module):
    """A cached loss over (anchor, positive) whose loss never reads the positives' embeddings."""

    mini_batch_size = 4
    mini_batch_num_tokens = None
    show_progress_bar = False

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def cached_loss(self) -> CachedLoss:
        """Its own description for st_ext's engine: ``calculate_loss`` is its loss over embeddings."""
        return described(self, lambda features, ranges, size: LossStep(lambda source: self.calculate_loss))

    def calculate_loss(self, reps, labels=None, *, with_backward=False):
        value = torch.cat(reps[0]).pow(2).mean()
        if with_backward:
            value.backward()
            value = value.detach()
        return value


def test_an_unused_column_is_named_before_the_backward(model):
    """Upstream PR #3862 (5.7, ``CachedLossMixin.forward_cached``): a loss that never reads a column's
    embeddings leaves them without a cached gradient; upstream raises a ValueError naming the column at
    the forward pass, instead of failing deep inside ``backward()``. st_ext raises the same, naming the
    column, before any replay; upstream before 5.7 has no shared engine to check it."""
    from st_ext.losses.gradcache import gradcache_forward

    features = features_of(model, text_columns(8, 2))
    with pytest.raises(ValueError, match=r"did not use input column\(s\) 1"):
        gradcache_forward(IgnoresSecondColumn(model).cached_loss(), [dict(f) for f in features], None)
    if upstream_engine is not None:

        class UpstreamIgnoresSecondColumn(IgnoresSecondColumn, upstream_engine.CachedLossMixin):
            pass

        with pytest.raises(ValueError, match=r"did not use input column\(s\) 1"):
            UpstreamIgnoresSecondColumn(model).forward_cached([dict(f) for f in features])


def test_a_frozen_column_is_not_back_propagated(model):
    """Upstream 5.4 (commit "skip backward for frozen Router routes", in the cached losses): a mini-batch
    whose embeddings carry no graph (a frozen route) is skipped in the replay, and a later trainable one
    of the same column still is back-propagated. st_ext skips it too, in one process: the cached loss's
    value and gradients are the uncached loss's, as upstream 6.2's cached loss's are; upstream 4.1 fails
    the backward. (Under DDP the frozen *final* mini-batch is the gap above.)"""
    model.append(worker.DetachedColumn()).eval()
    columns = text_columns(8, 3)
    features = features_of(model, columns)
    features[1][worker.FROZEN_COLUMN_KEY] = torch.ones(8, dtype=torch.bool)
    expected_value, expected = step_grads(model, st_losses().MultipleNegativesRankingLoss(model), features)
    ours = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3)
    value, grads = step_grads(model, ours, features)
    torch.testing.assert_close(value, expected_value, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, expected, 1e-4, "st_ext, frozen middle column")
    theirs = st_losses().CachedMultipleNegativesRankingLoss(model, mini_batch_size=3)
    if upstream_engine is not None:
        assert_grads_close(step_grads(model, theirs, features)[1], expected, 1e-4, "upstream")
    else:
        with pytest.raises(RuntimeError, match="does not require grad"):
            step_grads(model, theirs, features)
