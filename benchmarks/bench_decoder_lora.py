"""Peak memory of one training step of a decoder embedder with a LoRA adapter, at growing batch x sequence.

A Qwen3 decoder built from its config (random weights; ``--hidden``/``--layers``), last-token pooling, a LoRA
adapter (rank 8 on q/k/v/o) as the only trainable weights, MultipleNegativesRankingLoss over (query, passage)
pairs whose queries are a quarter of the passages' length. Five ways to run one step, measured in the same run:

* upstream uncached: sentence-transformers' ``MultipleNegativesRankingLoss``
* upstream cached: its ``CachedMultipleNegativesRankingLoss`` (``--mini-batch-size``), its own engine
* st_ext cached: ``st_ext.losses.CachedMultipleNegativesRankingLoss``, same mini-batch
* st_ext cached + checkpointing: the same with the decoder's layers checkpointed
* st_ext auto: ``mini_batch_size="auto"`` under ``--budget-mb`` (its first, measuring step not counted)

One step is forward + loss + backward. The meter is ``st_ext.memory.measure_peak`` (torch profiler allocation
events on the CPU: tensor storage above the level on entry, the adapter's gradients included). The ratio is
each peak over upstream uncached's at the same shape; "fits" says whether it stays within ``--budget-mb``.

    python benchmarks/bench_decoder_lora.py        # about ten minutes on a loaded 2-core CPU; the table in docs/llm-embedders.md
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from peft import LoraConfig
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3Model

from st_ext import SentenceTransformer, losses
from st_ext._compat import st_losses, st_modules
from st_ext.adapters import add_lora_adapter
from st_ext.memory import CPU_METER, measure_peak

upstream = st_losses()
VOCAB = 512


def tiny_decoder_embedder(folder: str, hidden: int, layers: int) -> SentenceTransformer:
    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>")),
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        padding_side="left",
    ).save_pretrained(folder)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=hidden // 8,
        max_position_embeddings=4096,
    )
    Qwen3Model(config).save_pretrained(folder)
    modules = st_modules()
    transformer = modules.Transformer(folder, max_seq_length=4096)
    pooling = modules.Pooling(hidden, pooling_mode="lasttoken")
    model = SentenceTransformer(modules=[transformer, pooling, modules.Normalize()], device="cpu")
    add_lora_adapter(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    return model


def features(batch: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, VOCAB, (batch, length), generator=generator)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def step_peak(model, loss, batch: int, seq: int) -> int:
    columns = [features(batch, max(seq // 4, 1), 1), features(batch, seq, 2)]
    model.zero_grad(set_to_none=True)
    with measure_peak("cpu") as peak:
        loss([dict(c) for c in columns], None).backward()
    model.zero_grad(set_to_none=True)
    return peak.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the decoder")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--mini-batch-size", type=int, default=4, help="rows per mini-batch of the cached losses")
    parser.add_argument(
        "--shapes", nargs="+", default=["8x128", "16x256", "32x512"], help="batch x passage length, in tokens"
    )
    parser.add_argument("--budget-mb", type=float, default=64.0, help="the memory budget of 'auto' and of 'fits'")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))

    with tempfile.TemporaryDirectory() as folder:
        model = tiny_decoder_embedder(folder, args.hidden, args.layers)
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
        print(
            f"Qwen3-shaped decoder, hidden {args.hidden}, {args.layers} layers, LoRA r=8 on q/k/v/o; queries 1/4 of the "
            f"passage length; mini-batch {size}; budget {args.budget_mb:g} MiB; meter: {CPU_METER}; "
            f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads\n"
        )
        print(f"| batch x seq | {' | '.join(ways)} |")
        print("|---" * (len(ways) + 1) + "|")
        for shape in args.shapes:
            batch, seq = (int(part) for part in shape.split("x"))
            cells, baseline = [], None
            for name, make in ways.items():
                loss = make()
                checkpointed = name.endswith("checkpointing")
                if checkpointed:
                    model.gradient_checkpointing_enable()
                if name == "st_ext auto":
                    step_peak(model, loss, batch, seq)  # the measuring step
                peak = step_peak(model, loss, batch, seq)
                if checkpointed:
                    model.gradient_checkpointing_disable()
                baseline = baseline or peak
                fits = "fits" if peak <= args.budget_mb * 2**20 else "over"
                cells.append(f"{peak / 2**20:.1f} MiB ({peak / baseline:.2f}x, {fits})")
            print(f"| {batch} x {seq} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
