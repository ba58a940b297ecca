"""st_ext.mining against pytorch-metric-learning 2.9.0 on the same inputs, in one run.

For each (batch, memory) shape, 100 classes: time (best of --repeats, PML and st_ext interleaved)
and peak memory of
* all triplet indices: ``lmu.get_all_triplets_indices`` vs ``st_ext.mining.all_triplets_indices``;
* margin mining, type "all": PML's ``TripletMarginMiner`` vs ``st_ext.mining.TripletMarginMiner``,
  on random embeddings (nearly every triplet violates the margin: the worst case for st_ext, whose
  cost follows the mined triplets) and on embeddings clustered by class, as from a partly trained
  model (a few percent mined; PML's cost is the same in both).
Ratios are PML / st_ext (above 1: st_ext is faster or smaller). A second table times tiny inputs,
where ``all_triplets_indices`` switches to a dense mask (``DENSE_MAX_ELEMENTS``).

Run by hand: ``python benchmarks/bench_mining.py [--repeats 3] [--device cpu|cuda] [--threads N]``.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import torch
from pytorch_metric_learning import __version__ as pml_version
from pytorch_metric_learning.miners import TripletMarginMiner as PMLTripletMarginMiner
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from st_ext import mining
from st_ext.memory import measure_peak

SHAPES = [(21, 10000), (512, 2000), (1000, 1000)]
NUM_CLASSES = 100
EMBEDDING_SIZE = 128
MARGIN = 0.2
CLUSTER_SPREAD = 1.2  # noise around unit-variance class centres: about 8% of triplets mined
TINY_SIZES = [16, 32, 48, 64, 96, 128]


def machine_name(device: torch.device) -> str:
    """What the figures were measured on, since absolute times only mean something there."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {torch.get_num_threads()} torch threads"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_time(function: Callable[[], object], device: torch.device) -> float:
    """Seconds for one call; the output is dropped before returning."""
    synchronize(device)
    start = time.perf_counter()
    output = function()
    synchronize(device)
    elapsed = time.perf_counter() - start
    del output
    return elapsed


def best_times(functions: list[Callable[[], object]], device: torch.device, repeats: int) -> list[float]:
    """Fastest of ``repeats`` calls of each function, calls interleaved so that a busy spell on a
    shared machine hits all of them alike."""
    best = [float("inf")] * len(functions)
    for _ in range(repeats):
        for index, function in enumerate(functions):
            best[index] = min(best[index], run_time(function, device))
    return best


def peak_bytes(function: Callable[[], object], device: torch.device) -> int:
    """Peak tensor memory of one call, output included (it is alive when the block exits)."""
    with measure_peak(device) as meter:
        output = function()
    del output
    return meter.peak_bytes


def make_inputs(batch: int, memory: int, device: torch.device, seed: int = 0):
    """Random labels over NUM_CLASSES for a batch and a memory bank, and two kinds of embeddings
    for each: random, and clustered around one random centre per class."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_CLASSES, (batch,), generator=generator)
    ref_labels = torch.randint(0, NUM_CLASSES, (memory,), generator=generator)
    centres = torch.randn(NUM_CLASSES, EMBEDDING_SIZE, generator=generator)

    def noise(rows: int, scale: float) -> torch.Tensor:
        return scale * torch.randn(rows, EMBEDDING_SIZE, generator=generator)

    embeddings = {
        "random": (noise(batch, 1.0), noise(memory, 1.0)),
        "clustered": (
            centres[labels] + noise(batch, CLUSTER_SPREAD),
            centres[ref_labels] + noise(memory, CLUSTER_SPREAD),
        ),
    }
    embeddings = {kind: (query.to(device), ref.to(device)) for kind, (query, ref) in embeddings.items()}
    return labels.to(device), ref_labels.to(device), embeddings


def check_same_output(pml_output, ours_output, same_order: bool) -> None:
    """Guard against timing two different computations."""
    if same_order:
        assert all(torch.equal(a, b) for a, b in zip(pml_output, ours_output)), "indices differ from PML"
    else:
        assert len(pml_output[0]) == len(ours_output[0]), "mined counts differ from PML"


def measure_case(name, pml_function, ours_function, device, repeats, same_order) -> dict:
    """Times, peaks and output size of one (PML, st_ext) pair of calls on the same inputs."""
    pml_output, ours_output = pml_function(), ours_function()
    check_same_output(pml_output, ours_output, same_order)
    num_triplets = len(ours_output[0])
    del pml_output, ours_output
    pml_seconds, ours_seconds = best_times([pml_function, ours_function], device, repeats)
    return {
        "name": name,
        "triplets": num_triplets,
        "output_bytes": 3 * 8 * num_triplets,
        "pml_s": pml_seconds,
        "ours_s": ours_seconds,
        "pml_peak": peak_bytes(pml_function, device),
        "ours_peak": peak_bytes(ours_function, device),
    }


def main_table(device: torch.device, repeats: int) -> list[dict]:
    rows = []
    for batch, memory in SHAPES:
        labels, ref_labels, embeddings = make_inputs(batch, memory, device)
        pml_miner = PMLTripletMarginMiner(margin=MARGIN, type_of_triplets="all")
        ours_miner = mining.TripletMarginMiner(margin=MARGIN, type_of_triplets="all")
        cases = [
            (
                "indices",
                lambda: lmu.get_all_triplets_indices(labels, ref_labels),
                lambda: mining.all_triplets_indices(labels, ref_labels),
                True,
            )
        ]
        for kind, (query, ref) in embeddings.items():
            cases.append(
                (
                    f"miner {kind}",
                    lambda query=query, ref=ref: pml_miner(query, labels, ref, ref_labels),
                    lambda query=query, ref=ref: ours_miner(query, labels, ref, ref_labels),
                    False,
                )
            )
        for name, pml_function, ours_function, same_order in cases:
            row = measure_case(name, pml_function, ours_function, device, repeats, same_order)
            row["shape"] = f"({batch}, {memory})"
            rows.append(row)
            print_row(row)
    return rows


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:9.1f}"


def print_header(meter: str) -> None:
    print(f"peak memory: {meter}; ratios are PML / st_ext")
    print(
        f"{'(batch, memory)':>16} {'what':>16} {'triplets':>10} {'PML s':>8} {'st_ext s':>9} {'speed-up':>9}"
        f" {'PML MiB':>9} {'st_ext MiB':>10} {'mem ratio':>9} {'output MiB':>10}"
    )


def print_row(row: dict) -> None:
    print(
        f"{row['shape']:>16} {row['name']:>16} {row['triplets']:>10} {row['pml_s']:8.3f} {row['ours_s']:9.3f}"
        f" {row['pml_s'] / row['ours_s']:8.1f}x {mib(row['pml_peak'])} {mib(row['ours_peak']):>10}"
        f" {row['pml_peak'] / max(row['ours_peak'], 1):8.1f}x {mib(row['output_bytes']):>10}",
        flush=True,
    )


def tiny_table(device: torch.device, repeats: int) -> None:
    """Dense mask vs grouped expansion vs PML on tiny self-referencing batches (B = M = n)."""
    print(f"\ntiny inputs, labels over n/4 classes, no ref_labels; microseconds, best of {repeats * 20}")
    print(f"{'n':>5} {'B*M*M':>9} {'PML':>8} {'dense':>8} {'grouped':>8}  chosen")
    for size in TINY_SIZES:
        generator = torch.Generator().manual_seed(size)
        labels = torch.randint(0, max(size // 4, 1), (size,), generator=generator).to(device)
        functions = [
            lambda: lmu.get_all_triplets_indices(labels),
            lambda: mining.dense_triplets_indices(labels, labels, True),
            lambda: mining.grouped_triplets_indices(labels, labels, True),
        ]
        times = [seconds * 1e6 for seconds in best_times(functions, device, repeats * 20)]
        elements = size**3
        chosen = "dense" if elements <= mining.DENSE_MAX_ELEMENTS else "grouped"
        print(f"{size:>5} {elements:>9} {times[0]:8.0f} {times[1]:8.0f} {times[2]:8.0f}  {chosen}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--skip-tiny", action="store_true", help="only the main table")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads; 1 gives steadier figures on a shared machine",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"machine: {machine_name(device)}; torch {torch.__version__}; pytorch-metric-learning {pml_version}")
    print(
        f"{NUM_CLASSES} classes, embeddings {EMBEDDING_SIZE}-d (clustered: spread {CLUSTER_SPREAD}), "
        f"margin {MARGIN}, best of {args.repeats}"
    )
    known_bytes = 64 * 2**20
    with measure_peak(device) as probe:
        known = torch.empty(known_bytes, dtype=torch.uint8, device=device).fill_(1)
    del known
    print(f"meter check: a {mib(known_bytes).strip()} MiB tensor reads as {mib(probe.peak_bytes).strip()} MiB")
    print_header(probe.meter)
    main_table(device, args.repeats)
    if not args.skip_tiny:
        tiny_table(device, args.repeats)


if __name__ == "__main__":
    main()
