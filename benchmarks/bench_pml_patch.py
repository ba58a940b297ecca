"""pytorch-metric-learning's ``get_all_triplets_indices``, released 2.9.0 against patches/pytorch-metric-learning, in one run.

The patch is applied to the released sdist (``.venv/sdists``, downloaded once, as the patch tests do) in a temporary
folder, and its module is loaded beside the installed one. For each (batch, memory) shape, 100 classes: the
number of triplets, time (best of --repeats, released and patched interleaved) and peak tensor memory (output
included) of each, and the ratios released / patched. The two must return the same triplets.

Run by hand: ``python benchmarks/bench_pml_patch.py [--repeats 5] [--threads N]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch
from bench_mining import best_times, machine_name, peak_bytes
from pytorch_metric_learning.utils import loss_and_miner_utils as released

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from _upstream_source import patch_files, patched_source  # noqa: E402  (the patch tests' sdist cache)

PACKAGE, VERSION = "pytorch-metric-learning", "2.9.0"
SHAPES = [(21, 10000), (512, 2000), (1000, 1000)]
NUM_CLASSES = 100


def patched_module(work_dir: Path):
    """``loss_and_miner_utils`` of the released sdist with the series applied."""
    tree = patched_source(PACKAGE, VERSION, patch_files(PACKAGE, VERSION), work_dir)
    # The patched package under another name, beside the installed one (its modules import each other relatively).
    package = tree / "src" / "pytorch_metric_learning"
    spec = importlib.util.spec_from_file_location(
        "patched_pml", package / "__init__.py", submodule_search_locations=[str(package)]
    )
    sys.modules["patched_pml"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["patched_pml"])
    return importlib.import_module("patched_pml.utils.loss_and_miner_utils")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    with tempfile.TemporaryDirectory() as work_dir:
        patched = patched_module(Path(work_dir))
        print(f"# {machine_name(device)}, torch {torch.__version__}, {NUM_CLASSES} classes")
        print(
            "| batch x memory | triplets | released s | patched s | time ratio | released MiB | patched MiB | memory ratio |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for batch, memory in SHAPES:
            generator = torch.Generator().manual_seed(0)
            labels = torch.randint(0, NUM_CLASSES, (batch,), generator=generator)
            ref_labels = torch.randint(0, NUM_CLASSES, (memory,), generator=generator)
            calls = [
                lambda: released.get_all_triplets_indices(labels, ref_labels),
                lambda: patched.get_all_triplets_indices(labels, ref_labels),
            ]
            before, after = calls[0](), calls[1]()
            assert all(torch.equal(x.long(), y) for x, y in zip(before, after)), "the patched triplets differ"
            triplets = len(after[0])
            del before, after
            times = best_times(calls, device, args.repeats)
            peaks = [peak_bytes(call, device) / 2**20 for call in calls]
            print(
                f"| {batch} x {memory} | {triplets / 1e6:.1f} M | {times[0]:.2f} | {times[1]:.2f} | "
                f"{times[0] / times[1]:.1f}x | {peaks[0]:.0f} | {peaks[1]:.0f} | {peaks[0] / peaks[1]:.1f}x |"
            )


if __name__ == "__main__":
    main()
