"""Peak memory of one training step of a decoder embedder with a LoRA adapter, at growing batch x sequence.

A Qwen3 decoder built from its config (random weights; ``--hidden``/``--layers``, or ``--qwen3-0.6b`` for the
shapes of Qwen3-0.6B and Qwen3-Embedding-0.6B), last-token pooling, a LoRA adapter (rank 8 on q/k/v/o) as the
only trainable weights, MultipleNegativesRankingLoss over (query, passage) pairs whose queries are a quarter of
the passages' length. Five ways to run one step, measured in the same run:

* upstream uncached: sentence-transformers' ``MultipleNegativesRankingLoss``
* upstream cached: its ``CachedMultipleNegativesRankingLoss`` (``--mini-batch-size``), its own engine
* st_ext cached: ``st_ext.losses.CachedMultipleNegativesRankingLoss``, same mini-batch
* st_ext cached + checkpointing: the same with the decoder's layers checkpointed
* st_ext auto: ``mini_batch_size="auto"`` under ``--budget-mb`` (its first, measuring step not counted)

One step is forward + loss + backward (``--dtype bf16``: weights in bf16 and the step under bf16 autocast).
The meter is ``st_ext.memory.measure_peak``: on the CPU the torch profiler's allocation events, on CUDA
``torch.cuda.max_memory_allocated``; both count what the step allocates above the level on entry (the
model's weights are held before it and not counted; the header says how much they take), the adapter's
gradients included. The ratio is each peak over upstream uncached's at the same shape; "fits" says whether
it stays within ``--budget-mb``. A step that runs out of CUDA memory is a cell of its own.

    python benchmarks/bench_decoder_lora.py        # about ten minutes on a loaded 2-core CPU; the table in docs/llm-embedders.md
    make gpu-report PART=8                         # on a CUDA GPU: Qwen3-0.6B's shapes, bf16, seq 512-1024
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import tempfile
from contextlib import nullcontext

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from peft import LoraConfig
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3Model

from st_ext import SentenceTransformer, losses
from st_ext._compat import st_losses, st_modules
from st_ext.adapters import add_lora_adapter
from st_ext.memory import CPU_METER, CUDA_METER, measure_peak

upstream = st_losses()
VOCAB = 512
#: Qwen/Qwen3-0.6B's config.json (Qwen3-Embedding-0.6B has the same shapes).
QWEN3_0_6B = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000,
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def decoder_config(args: argparse.Namespace) -> Qwen3Config:
    """Qwen3-0.6B's shapes with ``--qwen3-0.6b``, else a small Qwen3 of ``--hidden`` x ``--layers``."""
    if args.qwen3_0_6b:
        return Qwen3Config(**QWEN3_0_6B)
    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=args.hidden // 8,
        max_position_embeddings=4096,
    )


def decoder_embedder(folder: str, args: argparse.Namespace) -> SentenceTransformer:
    """The decoder with random weights (built on the device, saved in ``args.dtype``), last-token pooling and
    the LoRA adapter, on ``args.device`` in ``args.dtype`` with ``args.attention``."""
    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>")),
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        padding_side="left",
    ).save_pretrained(folder)
    torch.manual_seed(0)
    with torch.device(args.device):
        Qwen3Model(decoder_config(args)).to(DTYPES[args.dtype]).save_pretrained(folder)
    modules = st_modules()
    transformer = modules.Transformer(folder, max_seq_length=4096)
    pooling = modules.Pooling(transformer.get_word_embedding_dimension(), pooling_mode="lasttoken")
    model = SentenceTransformer(modules=[transformer, pooling, modules.Normalize()], device=args.device)
    model.to(DTYPES[args.dtype])
    if args.attention != "sdpa":  # transformers' default on every supported version
        transformer.auto_model.set_attn_implementation(args.attention)
    add_lora_adapter(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    return model


def features(batch: int, length: int, seed: int, device: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, VOCAB, (batch, length), generator=generator)
    return {"input_ids": input_ids.to(device), "attention_mask": torch.ones_like(input_ids, device=device)}


def step_peak(model, loss, batch: int, seq: int, args: argparse.Namespace) -> int:
    columns = [features(batch, max(seq // 4, 1), 1, args.device), features(batch, seq, 2, args.device)]
    autocast = torch.autocast(args.device, dtype=torch.bfloat16) if args.dtype == "bf16" else nullcontext()
    model.zero_grad(set_to_none=True)
    with measure_peak(args.device) as peak, autocast:
        loss([dict(c) for c in columns], None).backward()
    model.zero_grad(set_to_none=True)
    return peak.peak_bytes


def measured_cell(model, loss, batch: int, seq: int, args: argparse.Namespace, *, measuring_step: bool) -> dict:
    """One way's peak at one shape; a step that runs out of CUDA memory is recorded as such."""
    try:
        if measuring_step:
            step_peak(model, loss, batch, seq, args)
        return {"status": "ok", "peak_mib": step_peak(model, loss, batch, seq, args) / 2**20}
    except torch.cuda.OutOfMemoryError:
        return {"status": "out of memory"}


def cell_text(cell: dict) -> str:
    if cell["status"] != "ok":
        return cell["status"]
    ratio = f"{cell['ratio']:.2f}x, " if cell.get("ratio") is not None else ""
    return f"{cell['peak_mib']:.1f} MiB ({ratio}{'fits' if cell['fits'] else 'over'})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="bf16: bf16 weights and autocast")
    parser.add_argument("--attention", default="sdpa", help="transformers' attention (sdpa, flash_attention_2, eager)")
    parser.add_argument(
        "--qwen3-0.6b",
        dest="qwen3_0_6b",
        action="store_true",
        help="Qwen3-0.6B's shapes (overrides --hidden/--layers)",
    )
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the decoder")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--mini-batch-size", type=int, default=4, help="rows per mini-batch of the cached losses")
    parser.add_argument(
        "--shapes", nargs="+", default=["8x128", "16x256", "32x512"], help="batch x passage length, in tokens"
    )
    parser.add_argument("--budget-mb", type=float, default=64.0, help="the memory budget of 'auto' and of 'fits'")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (0: torch's default)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Print the table; returns the settings and, per shape, each way's cell."""
    args = parse_args(argv)
    if args.device == "cpu" and args.threads:
        torch.set_num_threads(min(args.threads, torch.get_num_threads()))

    with tempfile.TemporaryDirectory() as folder:
        model = decoder_embedder(folder, args)
        model.train()
        size = args.mini_batch_size
        ways = {
            "upstream uncached": lambda: upstream.MultipleNegativesRankingLoss(model),
            "upstream cached": lambda: upstream.CachedMultipleNegativesRankingLoss(model, mini_batch_size=size),
            "st_ext cached": lambda: losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=size),
            "st_ext cached + checkpointing": lambda: losses.CachedMultipleNegativesRankingLoss(
                model, mini_batch_size=size
            ),
            "st_ext auto": lambda: losses.CachedMultipleNegativesRankingLoss(
                model, mini_batch_size="auto", memory_budget_mb=args.budget_mb
            ),
        }
        config = model[0].auto_model.config
        weights_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        processor = (
            torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
        )
        settings = {
            "shape": "Qwen3-0.6B"
            if args.qwen3_0_6b
            else f"hidden {config.hidden_size}, {config.num_hidden_layers} layers",
            "dtype": args.dtype,
            "attention": args.attention,
            "mini_batch_size": size,
            "budget_mib": args.budget_mb,
            "weights_mib": weights_mib,
            "meter": CUDA_METER if args.device == "cuda" else CPU_METER,
            "torch": torch.__version__,
            "device": processor,
        }
        print(
            f"Qwen3-shaped decoder ({settings['shape']}, random weights, {weights_mib:.1f} MiB held before each step), "
            f"{args.dtype}, {args.attention} attention, LoRA r=8 on q/k/v/o; queries 1/4 of the passage length; "
            f"mini-batch {size}; budget {args.budget_mb:g} MiB; meter: {settings['meter']}; torch {torch.__version__}, "
            f"{processor}" + (f", {torch.get_num_threads()} threads" if args.device == "cpu" else "") + "\n"
        )
        print(f"| batch x seq | {' | '.join(ways)} |")
        print("|---" * (len(ways) + 1) + "|")
        rows = []
        for shape in args.shapes:
            batch, seq = (int(part) for part in shape.split("x"))
            cells = {}
            for name, make in ways.items():
                loss = make()
                checkpointed = name.endswith("checkpointing")
                if checkpointed:
                    model.gradient_checkpointing_enable()
                try:
                    cells[name] = measured_cell(model, loss, batch, seq, args, measuring_step=name == "st_ext auto")
                finally:
                    if checkpointed:
                        model.gradient_checkpointing_disable()
                del loss  # with what a step cut short by running out of memory left behind
                model.zero_grad(set_to_none=True)
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            baseline = cells["upstream uncached"].get("peak_mib")
            for cell in cells.values():
                if cell["status"] == "ok":
                    cell["fits"] = cell["peak_mib"] <= args.budget_mb
                    cell["ratio"] = cell["peak_mib"] / baseline if baseline else None
            rows.append({"batch": batch, "seq": seq, "cells": cells})
            print(f"| {batch} x {seq} | {' | '.join(cell_text(cell) for cell in cells.values())} |", flush=True)
    return {"settings": settings, "rows": rows}


if __name__ == "__main__":
    main()
