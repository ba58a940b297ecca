"""``mini_batch_size="auto"``: the largest mini-batch whose training step fits a memory budget, measured.

A cached step peaks at one mini-batch's forward and backward with a graph, plus the batch's
embeddings and the loss's score blocks (estimated), or at the optimizer's update when st_ext's
trainer hands the optimizer over (:attr:`AutoMiniBatch.optimizer`). The graph part is measured on
the batch in hand, on its *longest* rows, for sizes 1, 2, 4, ... up to the whole batch (measured as the
one pass the engine would run, its columns embedded as planned), and the largest size that fits is kept,
until a batch has more rows or a longer row. The log line says what was chosen, the step peak it expects
(what the step then measures, within :data:`EXPECTED_MARGIN`) and how long measuring took. Measuring leaves no
trace (gradients already in ``.grad`` are put back, the random state is forked), and an out-of-memory
error counts as over budget. Where the model can checkpoint, larger sizes are measured again with
checkpointing on, and taken when the measured times say the step is faster. What the chosen size
leaves of the budget holds kept graphs (partial caching: a kept mini-batch is not embedded a second
time): what a graph of the chosen size holds, and the peaks of the step's phases it adds to, are
measured at that size (:class:`KeptGraphCosts`), each by a probe no larger than the replayed step
already measured there. docs/speed.md says the rest.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import torch
from torch import Tensor, nn

from st_ext import checkpointing
from st_ext._compat import compiled_module
from st_ext.gradient_sync import gradient_sync
from st_ext.losses.features import ColumnLayout, Features, minibatch_features
from st_ext.losses.minibatches import Segment, can_merge, plan_minibatches
from st_ext.memory import measure_peak

logger = logging.getLogger(__name__)

AUTO: Final = "auto"
#: How far a step's measured peak may be from the figure the auto mode expected for it (the estimated score
#: blocks and the meter's noise); benchmarks/bench_real_lengths.py checks it.
EXPECTED_MARGIN = 0.15
#: Share of the free CUDA memory the default budget takes; the rest absorbs allocator fragmentation.
CUDA_BUDGET_FRACTION = 0.8
#: Bytes per trainable parameter the first optimizer step has yet to allocate: its gradient and
#: Adam's two moments, in fp32.
PENDING_BYTES_PER_PARAMETER = 12


@dataclass
class AutoChoice:
    """What the auto mode chose, and what it measured (peaks in bytes, estimates included)."""

    size: int
    rows: int
    longest_row: int
    budget_bytes: int | None
    meter: str = ""
    tried: dict[int | str, int] = field(default_factory=dict)
    checkpointing: bool = False
    #: Forward passes at ``size``, and how many of them keep their graph for the backward (partial caching).
    minibatches: int = 1
    kept: int = 0
    #: What one kept graph holds from its forward to the backward, measured (None: the whole batch is one pass).
    kept_graph_bytes: int | None = None
    #: The step's expected peak with one more graph kept (None: all but one are kept, or nothing measured).
    one_more_bytes: int | None = None
    #: The step's peak at the choice (its graphs kept included), as measured and estimated here: the figure
    #: the step then measures, within :data:`EXPECTED_MARGIN` (None: no budget, nothing measured).
    expected_bytes: int | None = None
    #: Wall-clock seconds the measurement took (its probes' forward and backward passes).
    probe_seconds: float = 0.0
    #: Input columns of the batch (``rows`` counts the texts of all of them).
    columns: int = 1

    def __str__(self) -> str:
        texts = f"{self.rows} texts" + (f" in {self.columns} columns" if self.columns > 1 else "")
        if self.size >= self.rows:
            how = f"one pass over all {texts}: the plain forward and backward"
        else:
            how = f"{self.minibatches} forward passes of at most {self.size} texts each, over {texts}"
            if self.kept:
                how += (
                    f"; the first {self.kept} keep their graphs "
                    f"({_mib(self.kept_graph_bytes or 0)} each until the backward)"
                )
            elif self.one_more_bytes is not None:
                how += f"; no graph kept (keeping one would take the step to {_mib(self.one_more_bytes)})"
        if self.checkpointing:
            how += ", with gradient checkpointing"
        if self.budget_bytes is None:
            return f"mini_batch_size auto -> {self.size} ({how}; no memory budget on this device, nothing measured)"
        tried = ", ".join(
            f"{size}: {peak / 2**20:.0f} MiB" if peak >= 0 else f"{size}: out of memory"
            for size, peak in self.tried.items()
        )
        expected = "" if self.expected_bytes is None else f"expected step peak {_mib(self.expected_bytes)}; "
        return (
            f"mini_batch_size auto -> {self.size} ({how}; longest row {self.longest_row} tokens; {expected}"
            f"budget {_mib(self.budget_bytes)}, {self.meter}; measuring took {self.probe_seconds:.1f} s; "
            f"step peak by size, estimated from probes: {tried})"
        )


class BudgetTooSmallError(ValueError):
    """Not even a mini-batch of one row fits the memory budget."""


class AutoMiniBatch:
    """The auto mode's state for one loss: its budget and its latest measured choice."""

    def __init__(self, memory_budget_mb: float | None = None) -> None:
        if memory_budget_mb is not None and (
            isinstance(memory_budget_mb, bool)
            or not isinstance(memory_budget_mb, (int, float))
            or memory_budget_mb <= 0
        ):
            raise ValueError(f"memory_budget_mb must be a positive number of MiB or None, got {memory_budget_mb!r}.")
        self.memory_budget_mb = memory_budget_mb
        self.choice: AutoChoice | None = None
        #: The optimizer whose update the budget must also hold (set by st_ext's trainers), or None.
        self.optimizer: torch.optim.Optimizer | None = None

    def __repr__(self) -> str:
        return f"AutoMiniBatch(memory_budget_mb={self.memory_budget_mb!r}, choice={self.choice})"

    def choice_for(
        self, model: nn.Module, sentence_features: Sequence[Features], layouts: Sequence[ColumnLayout]
    ) -> AutoChoice:
        """The last choice, or a new measurement when this batch has more rows or a longer row."""
        rows = sum(layout.rows for layout in layouts)
        longest = max(_longest_row(features, layout) for features, layout in zip(sentence_features, layouts))
        if self.choice is None or rows > self.choice.rows or longest > self.choice.longest_row:
            began = time.perf_counter()
            self.choice = self._measure(model, sentence_features, layouts, rows, longest)
            self.choice.probe_seconds = time.perf_counter() - began
            logger.info(str(self.choice))
        return self.choice

    def budget_bytes(self, model: nn.Module, device: torch.device) -> int | None:
        if self.memory_budget_mb is not None:
            return int(self.memory_budget_mb * 2**20)
        if device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if self.optimizer is not None:  # the step estimate includes the update
            return int(CUDA_BUDGET_FRACTION * free)
        pending = sum(p.numel() for p in model.parameters() if p.requires_grad and p.grad is None)
        return int(CUDA_BUDGET_FRACTION * max(free - pending * PENDING_BYTES_PER_PARAMETER, 0))

    def _measure(
        self,
        model: nn.Module,
        sentence_features: Sequence[Features],
        layouts: Sequence[ColumnLayout],
        rows: int,
        longest: int,
    ) -> AutoChoice:
        device = _device_of(sentence_features)
        budget = self.budget_bytes(model, device)
        choice = AutoChoice(size=rows, rows=rows, longest_row=longest, budget_bytes=budget, columns=len(layouts))
        if budget is None:
            return choice
        update = optimizer_step_bytes(self.optimizer) if self.optimizer is not None else 0
        if update > budget:
            raise BudgetTooSmallError(
                f"mini_batch_size='auto': the optimizer's update alone (gradients, the states its first step "
                f"allocates, temporaries) needs {_mib(update)}, above the {_mib(budget)} budget. Raise "
                "memory_budget_mb, or choose a lighter optimizer (the training arguments' optim, e.g. 'adafactor')."
            )
        series = _Series(model, sentence_features, layouts, rows, budget, device, update_bytes=update)
        plain = series.largest_fitting(1)
        choice.size, choice.meter = plain, series.meter
        choice.tried = {size: peak for size, peak in series.peaks.items()}
        if not plain:
            needed = series.peaks.get(1, -1)
            raise BudgetTooSmallError(
                f"mini_batch_size='auto': even a mini-batch of one row (the batch's longest, {longest} tokens) needs "
                + (_mib(needed) if needed >= 0 else "more memory than is free")
                + f", above the {_mib(budget)} budget. Raise memory_budget_mb, shorten max_seq_length, "
                "or enable gradient checkpointing."
            )
        if plain < rows and checkpointing.checkpointable_modules(model) and not checkpointing.is_enabled(model):
            # The lever: recomputing activations in the backward pass may let a larger mini-batch fit, and
            # fewer, larger passes can be faster than the recomputation costs.
            with_checkpointing = _Series(
                model, sentence_features, layouts, rows, budget, device, checkpointed=True, update_bytes=update
            )
            # It starts at the size that fits without checkpointing, so that each larger size is extrapolated
            # (from that point, with the plain series' slope) before it is probed: a probe passing the budget
            # would take the step that measures over it.
            with_checkpointing.slope_hint = series.slope()
            larger = with_checkpointing.largest_fitting(plain)
            choice.tried.update({f"{size}+ckpt": peak for size, peak in with_checkpointing.peaks.items()})
            if larger > plain and with_checkpointing.step_seconds(larger) < series.step_seconds(plain):
                choice.size, choice.checkpointing = larger, True
                series = with_checkpointing
        choice.minibatches = series.minibatches(choice.size)
        choice.expected_bytes = series.peaks[choice.size]
        costs = series.kept_graph_costs(choice.size) if choice.size < rows else None
        if costs is not None:
            # Keep as many graphs as the budget holds, at most all but one (were every one kept, the batch
            # would be one pass, which did not fit).
            expected = series.peaks_by_kept_graphs(choice.size, costs)
            choice.kept = max(kept for kept, peak in enumerate(expected) if kept == 0 or peak <= budget)
            choice.kept_graph_bytes = costs.held
            choice.expected_bytes = expected[choice.kept]
            choice.one_more_bytes = expected[choice.kept + 1] if choice.kept + 1 < len(expected) else None
        return choice


@dataclass(frozen=True)
class KeptGraphCosts:
    """A cached step's graph-part peaks at one mini-batch size, measured there, from which its peak with ``k``
    of its graphs kept follows. The step runs in three phases: the first pass embeds the kept mini-batches with
    their graphs and the others without; the kept graphs are back-propagated in one backward, the last one
    built first (autograd runs them one after another, so the others stay alive meanwhile); the others are
    replayed one at a time. A kept graph's backward peaks at the first one's, from the gradients the step started
    with, or at a replayed one's once those gradients are in place, with the graphs not yet back-propagated
    alive beside it. Each probe runs no more than one mini-batch of the chosen size, so none needs more
    memory than the replayed step already measured to fit."""

    #: The full-GradCache step's graph part: one mini-batch's forward and backward, again with the
    #: parameters' gradients in place (the replays).
    replayed: int
    #: One graph back-propagated from the gradients the step starts with (the first kept graph's backward
    #: allocates the parameters' gradients as its own activations are freed).
    first_backward: int
    #: A forward pass with its graph, at its peak, and what its graph holds once it returns.
    forward: int
    held: int
    #: A forward pass without a graph (the other mini-batches' first pass).
    no_graph: int

    def graph_peak(self, kept: int) -> int:
        """The step's graph-part peak with its first ``kept`` graphs kept (at most all but one)."""
        if kept == 0:
            return self.replayed
        others = (kept - 1) * self.held
        return max(
            self.replayed,
            others + self.forward,  # the last kept forward
            kept * self.held + self.no_graph,  # the other mini-batches' first pass
            others + self.first_backward,  # the first kept graph's backward
            others - self.held + self.replayed,  # the second's, the parameters' gradients in place
        )


class _Series:
    """Probes of doubling mini-batch sizes on the batch's longest rows: peak bytes (estimates of the
    rest of the step included) and seconds of each, with or without gradient checkpointing."""

    def __init__(
        self,
        model,
        sentence_features,
        layouts,
        rows,
        budget,
        device,
        *,
        checkpointed: bool = False,
        update_bytes: int = 0,
    ):
        self.model, self.sentence_features, self.layouts = model, sentence_features, layouts
        self.rows, self.budget, self.device, self.checkpointed = rows, budget, device, checkpointed
        self.update_bytes = update_bytes
        self.graphs: dict[int, int] = {}  # measured graph peaks by size
        self.cells: dict[int, int] = {}  # padded token positions each measured size embedded
        self.forwards: dict[int, int] = {}  # each measured size's forward peak, from no gradients
        #: The parameters' gradients a step allocates (none where it starts with them, as accumulation does).
        self.gradient_bytes = sum(
            p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and p.grad is None
        )
        self.slope_hint: float | None = None
        self.order = _longest_first(sentence_features, layouts)
        self.peaks: dict[int, int] = {}
        self.seconds: dict[int, float] = {}
        self.meter = ""
        self.dim = 0  # the embedding size, once a probe has run

    def largest_fitting(self, start: int) -> int:
        """The largest probed size from ``start`` up whose step fits the budget (0: none). Sizes below the
        batch probe one mini-batch of the batch's longest rows; the whole batch probes the one pass the engine
        would run (its forward passes as planned, every graph alive, one backward)."""
        fitting = 0
        sizes = list(_candidates(len(self.order), start))
        if len(self.order) < self.rows and (not sizes or sizes[-1] == len(self.order)):
            sizes.append(self.rows)  # columns embedded apart: one pass over the batch holds every column's graph
        for size in sizes:
            whole = size >= self.rows
            predicted = self._whole_batch_extrapolated() if whole else self._extrapolated(size)
            estimate = None if predicted is None else self.step_peak(predicted, size)
            if estimate is not None and estimate > self.budget:
                # The graph grows linearly with the rows: a probe this size would pass the budget
                # itself, on the step that measures. Its estimate stands in for it.
                self.peaks[size] = estimate
                return fitting
            batches = self._whole_batch() if whole else [self._longest(size)]
            passes = 1 if whole else 2
            began = time.perf_counter()
            with checkpointing.switched_on(self.model) if self.checkpointed else contextlib.nullcontext():
                probe = _probe_peak(self.model, batches[0], self.device, passes, more=batches[1:])
            self.seconds[size] = (time.perf_counter() - began) / passes
            graph_peak, self.dim, self.meter = probe.peak, probe.dim, probe.meter
            peak = None if graph_peak is None else self.step_peak(graph_peak, size)
            self.peaks[size] = -1 if peak is None else peak
            if graph_peak is not None:
                self.graphs[size] = graph_peak
                self.cells[size] = sum(_padded_cells(batch) for batch in batches)
                self.forwards[size] = probe.forward_peak
            if peak is None or peak > self.budget:
                return fitting
            fitting = size
        return fitting

    def _longest(self, size: int) -> Features:
        """One mini-batch of the batch's ``size`` longest rows (of every column where columns share passes)."""
        return minibatch_features(
            self.sentence_features, self.layouts, tuple(Segment(c, r, r + 1) for c, r in self.order[:size])
        )

    def _whole_batch(self) -> list[Features]:
        """The forward passes of the engine's one pass over the batch, as it plans them."""
        plan = plan_minibatches(self.sentence_features, self.layouts, self.rows)
        return [minibatch_features(self.sentence_features, self.layouts, minibatch) for minibatch in plan.minibatches]

    def _whole_batch_extrapolated(self) -> int | None:
        """The one pass's graph peak by padded token positions (short queries beside long passages cost less
        than their rows say)."""
        if not self.graphs:
            return None
        return self._on_the_line(sum(_padded_cells(batch) for batch in self._whole_batch()), self.cells)

    def step_peak(self, graph_peak: int, size: int) -> int:
        """A step's peak at ``size`` from its graph part: the larger of the backward and the update."""
        return max(self._backward_peak(graph_peak, size), self.update_bytes)

    def _backward_peak(self, graph_peak: int, size: int) -> int:
        """Beyond one mini-batch's graph, the backward holds the batch's embeddings, their cached gradients
        and a transformed copy (Matryoshka, normalisation), in fp32, and the loss's score block for ``size``
        anchors against every candidate with its softmax and gradient (estimated)."""
        anchors = self.layouts[0].rows
        candidates = self.rows - anchors if len(self.layouts) > 1 else self.rows
        return graph_peak + 4 * (3 * self.rows * self.dim + 3 * min(size, anchors) * max(candidates, 1))

    def minibatches(self, size: int) -> int:
        """The forward passes of a batch at ``size``, as the engine plans them."""
        return len(plan_minibatches(self.sentence_features, self.layouts, size).minibatches)

    def peaks_by_kept_graphs(self, size: int, costs: KeptGraphCosts) -> list[int]:
        """The step's expected peak at ``size`` with 0, 1, ... of its graphs kept, short of all (were every one
        kept, the batch would be one pass)."""
        return [self.step_peak(costs.graph_peak(kept), size) for kept in range(self.minibatches(size))]

    def kept_graph_costs(self, size: int) -> KeptGraphCosts | None:
        """What keeping graphs of ``size`` rows costs, measured on that size's longest rows (None: out of memory)."""
        features = self._longest(size)
        with checkpointing.switched_on(self.model) if self.checkpointed else contextlib.nullcontext():
            first_backward = _probe_peak(self.model, features, self.device, 1)
            no_graph = _probe_peak(self.model, features, self.device, 1, graph=False)
        if first_backward.peak is None or no_graph.peak is None:
            return None
        return KeptGraphCosts(
            replayed=self.graphs[size],
            first_backward=first_backward.peak,
            forward=first_backward.forward_peak,
            held=first_backward.held,
            no_graph=no_graph.peak,
        )

    def slope(self) -> float | None:
        """Graph bytes per row, from the last two measured sizes (None: fewer measured)."""
        return self._slope(self._row_positions())

    def _slope(self, positions: Mapping[int, int]) -> float | None:
        """Graph bytes per unit of ``positions`` (each measured size's, in rows or padded token positions) between
        the last two measured sizes (None: fewer measured, or both at one position)."""
        if len(self.graphs) < 2:
            return None
        (small, low), (large, high) = sorted(self.graphs.items())[-2:]
        spread = positions[large] - positions[small]
        return max(high - low, 0) / spread if spread > 0 else None

    def _row_positions(self) -> dict[int, int]:
        return {size: size for size in self.graphs}

    def _extrapolated(self, size: int) -> int | None:
        """The graph peak at ``size`` rows, before two sizes are measured on the hint's slope (the plain series
        bounds the checkpointed one)."""
        return self._on_the_line(size, self._row_positions(), self.slope_hint)

    def _on_the_line(self, at: int, positions: Mapping[int, int], slope_hint: float | None = None) -> int | None:
        """The graph peak at position ``at`` (``positions``: each measured size's, in rows or padded token
        positions) on the line through the last two measured sizes (before two, with ``slope_hint``'s slope),
        and at least a forward pass there beside the parameters' gradients (the replays' forward), the last
        measured forward scaled. Where the gradients (and a dense embedding gradient in the backward) set the
        peak, it stays flat over the first sizes and so does the line through them, until the forward's
        activations take over: the forward's share says where that happens before a probe would pass the
        budget finding out. None: nothing measured yet, or the last size at no position."""
        if not self.graphs:
            return None
        large, high = max(self.graphs.items())
        reached = positions[large]
        if reached <= 0:
            return None
        estimate = max(high, self.gradient_bytes + self.forwards[large] * at / reached)
        slope = self._slope(positions) if len(self.graphs) >= 2 else slope_hint
        if slope is not None:
            estimate = max(estimate, high + slope * (at - reached))
        return int(estimate)

    def step_seconds(self, size: int) -> float:
        """A step's estimated time at ``size``: one plain pass, or a no-grad and a graph pass per mini-batch
        (a no-grad forward costs about a third of a forward and backward, a quarter with checkpointing)."""
        if size >= self.rows:
            return self.seconds[size]
        passes = -(-self.rows // size)
        return passes * self.seconds[size] * (1.25 if self.checkpointed else 4 / 3)


def _candidates(limit: int, start: int) -> Iterator[int]:
    size = start
    while size < limit:
        yield size
        size *= 2
    if limit >= start:
        yield limit


def _padded_cells(features: Features) -> int:
    """Token positions a forward pass over ``features`` computes, padding included."""
    input_ids = features.get("input_ids")
    return int(input_ids.numel()) if isinstance(input_ids, Tensor) else 0


def _longest_row(features: Features, layout: ColumnLayout) -> int:
    if layout.lengths is not None and layout.rows:
        return int(layout.lengths.max())
    input_ids = features.get("input_ids")
    return int(input_ids.shape[-1]) if isinstance(input_ids, Tensor) and input_ids.ndim else 0


def _longest_first(sentence_features: Sequence[Features], layouts: Sequence[ColumnLayout]) -> list[tuple[int, int]]:
    """(column, row) pairs, longest rows first: of every column when columns share forward passes,
    else of the column whose longest row is longest (forward passes then never mix columns)."""
    if can_merge(sentence_features, layouts):
        columns = list(range(len(layouts)))
    else:
        columns = [max(range(len(layouts)), key=lambda c: _longest_row(sentence_features[c], layouts[c]))]
    pairs = [(c, r) for c in columns for r in range(layouts[c].rows)]
    lengths = {}
    for c in columns:
        column_lengths = layouts[c].lengths
        if column_lengths is None:  # the features say nothing about padding: every row counts alike
            return pairs
        lengths[c] = column_lengths
    pairs.sort(key=lambda pair: -int(lengths[pair[0]][pair[1]]))
    return pairs


def _mib(nbytes: float) -> str:
    """MiB with enough digits that a small figure does not read as 0."""
    mib = nbytes / 2**20
    return f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.2g} MiB"


def _device_of(sentence_features: Sequence[Features]) -> torch.device:
    for features in sentence_features:
        for value in features.values():
            if isinstance(value, Tensor):
                return value.device
    return torch.device("cpu")


class _Probe(NamedTuple):
    """What one probe measured: its peak bytes (None: out of memory); its first forward's peak and what that
    forward's graphs hold once it returns; the embedding size and the meter."""

    peak: int | None
    forward_peak: int
    held: int
    dim: int
    meter: str


def _probe_peak(
    model: nn.Module,
    features: Features,
    device: torch.device,
    passes: int,
    *,
    graph: bool = True,
    more: Sequence[Features] = (),
) -> _Probe:
    """Peak bytes of ``passes`` forward and backward passes with a graph over ``features``, and of the first
    forward alone with what its graphs hold once it returns (measured inside, at no extra pass). ``more``:
    further features each pass embeds before that backward (the other forward passes of a one-pass step);
    without ``graph``, one forward pass without a graph.

    The random state is forked: the probes' dropout leaves the step's draws as a fixed mini-batch makes them.

    Two passes for a cached step: its first replayed mini-batch allocates the parameters' gradients
    (unless the step starts with gradients already there), and every later one adds a fresh gradient
    to them. The gradients accumulate in ``.grad`` as in training: the ones already there are set
    aside, zeros of their shape stand in for them (allocated before the meter starts, as a step that
    accumulates would find them), and the originals are put back untouched.
    """
    module = compiled_module(model)  # torch.compile: no recompilation for probe shapes
    local = gradient_sync(module, sync=False)
    params = [p for p in module.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    dim, meter, forward_peak, held = 0, "", 0, 0
    try:
        for param, grad in zip(params, saved):
            param.grad = None if grad is None else torch.zeros_like(grad)
        rng_devices = [device] if device.type == "cuda" else []  # dropout in a probe must not move the step's RNG
        grad_mode = torch.enable_grad() if graph else torch.no_grad()
        with local, torch.random.fork_rng(devices=rng_devices), measure_peak(device) as peak, grad_mode:
            meter = peak.meter
            for index in range(passes):
                with measure_peak(device) if index == 0 else contextlib.nullcontext() as forward:
                    # A SentenceTransformer writes its outputs into the features it is given: a copy keeps a
                    # graph the probe holds from outliving it in the caller's features.
                    outputs = [module(dict(batch))["sentence_embedding"] for batch in [features, *more]]
                if forward is not None:
                    forward_peak, held = forward.peak_bytes, forward.end_bytes
                dim = outputs[0].shape[-1]
                if not outputs[0].requires_grad:
                    break
                sum(output.float().pow(2).sum() for output in outputs).backward()
                del outputs
    except torch.cuda.OutOfMemoryError:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return _Probe(None, forward_peak, held, dim, meter)
    finally:
        for param, grad in zip(params, saved):
            param.grad = grad
    return _Probe(peak.peak_bytes, forward_peak, held, dim, meter)


#: Optimizer states per parameter that a first step allocates, by optimizer class name (others: 2, as Adam).
STATES_PER_PARAMETER = {"SGD": 1, "Adagrad": 1, "RMSprop": 1, "Adam": 2, "AdamW": 2}


def optimizer_step_bytes(optimizer: torch.optim.Optimizer) -> int:
    """What ``optimizer``'s update holds above a step's start, estimated: the gradients (a step starts
    without them: the trainer sets them to None), the states its first step allocates, and the update's
    temporaries (a copy of every parameter with the foreach implementation, of the largest one without,
    none when fused)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    states = STATES_PER_PARAMETER.get(type(optimizer).__name__, 2)
    total = 0
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.requires_grad]
        nbytes = [p.numel() * p.element_size() for p in params]
        total += sum(nbytes)  # gradients
        pending_states = states + bool(group.get("amsgrad")) if states else 0
        total += sum(n for p, n in zip(params, nbytes) if not optimizer.state.get(p)) * pending_states
        if group.get("fused"):
            continue
        foreach = group.get("foreach")
        if foreach or (foreach is None and params and all(p.is_cuda for p in params)):
            total += sum(nbytes)
        else:
            total += max(nbytes, default=0)
    return total


def make_auto_mini_batch(
    mini_batch_size: Any,
    mini_batch_num_tokens: int | None,
    memory_budget_mb: float | None,
    kept_graphs: int | None = None,
) -> AutoMiniBatch | None:
    """The :class:`AutoMiniBatch` a loss constructed with these settings keeps (None unless ``"auto"``),
    after refusing settings no cached loss takes."""
    if mini_batch_size != AUTO and (
        isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or mini_batch_size <= 0
    ):
        raise ValueError(f"mini_batch_size must be a positive integer or 'auto', got {mini_batch_size!r}.")
    if mini_batch_num_tokens is not None and mini_batch_num_tokens <= 0:
        raise ValueError(f"mini_batch_num_tokens must be a positive integer or None, got {mini_batch_num_tokens!r}.")
    if kept_graphs is not None:
        if isinstance(kept_graphs, bool) or not isinstance(kept_graphs, int) or kept_graphs < 0:
            raise ValueError(f"kept_graphs must be a whole number of mini-batches or None, got {kept_graphs!r}.")
        if mini_batch_size == AUTO:
            raise ValueError(
                "mini_batch_size='auto' chooses how many graphs to keep from its measured budget: leave "
                "kept_graphs at None, or give mini_batch_size a number."
            )
    if mini_batch_size != AUTO:
        if memory_budget_mb is not None:
            raise ValueError("memory_budget_mb applies to mini_batch_size='auto' only; set mini_batch_size='auto'.")
        return None
    if mini_batch_num_tokens is not None:
        raise ValueError(
            "mini_batch_size='auto' chooses the mini-batch itself: leave mini_batch_num_tokens at None, or give "
            "mini_batch_size a number."
        )
    return AutoMiniBatch(memory_budget_mb)


def auto_mini_batch_of(loss: nn.Module) -> AutoMiniBatch | None:
    """The auto-mode state of ``loss`` or of the cached loss it wraps (Matryoshka, cross-batch memory)."""
    current: nn.Module | None = loss
    while current is not None:
        state = getattr(current, "auto_mini_batch", None)
        if isinstance(state, AutoMiniBatch):
            return state
        current = getattr(current, "loss", None)
    return None
