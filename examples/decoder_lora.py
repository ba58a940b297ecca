"""A decoder embedder trained with a LoRA adapter, cached Matryoshka MNRL and gradient checkpointing.

Decoder embedders (Qwen3-Embedding, gte-Qwen2, e5-mistral) embed a text as the hidden state of its last
token, pad on the left and put an instruction before each query; they are usually fine-tuned with a LoRA
adapter. Here the adapter is attached with st_ext.adapters.add_lora_adapter (upstream's
``model.add_adapter`` where the installed transformers accepts the installed peft, peft's ``get_peft_model``
otherwise), the loss is st_ext's MatryoshkaLoss over CachedMultipleNegativesRankingLoss (memory of one
mini-batch whatever the batch size), the layers are checkpointed, and only the adapter trains. The adapter
is saved as peft writes it, and the reloaded model encodes exactly as the trained one.

By default it runs offline on a tiny Qwen3 built here from its config (random weights, a word-level
tokenizer over the training texts), so it says nothing about quality; at its defaults (4 steps of 16 pairs) it
took 71 s on a 2-core CPU shared with other jobs (load average 10). ``--model`` takes a real one:

    python examples/decoder_lora.py                                   # tiny local decoder: 71 s on a loaded CPU
    python examples/decoder_lora.py --model Qwen/Qwen3-Embedding-0.6B --batch-size 64 --mini-batch-size 8 --max-steps 100
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from datasets import Dataset
from peft import LoraConfig

from st_ext import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments, losses
from st_ext._compat import st_modules
from st_ext.adapters import add_lora_adapter
from st_ext.cli.demo_data import stdlib_pairs

QUERY_PROMPT = "Instruct: Given a question, retrieve the passage that answers it\nQuery: "


def build_tiny_qwen3(path: str, texts: list[str]) -> str:
    """Save a randomly initialised 2-layer Qwen3 (hidden 64) with a word-level tokenizer over ``texts`` that
    appends an end-of-text token and pads on the left, as Qwen's tokenizers do."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3Model

    words = sorted({word for text in texts for word in text.lower().split()})
    vocab = {token: index for index, token in enumerate(["<|endoftext|>", "<unk>", *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", 0)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<|endoftext|>", padding_side="left"
    ).save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=0,
    )
    Qwen3Model(config).save_pretrained(path)
    return path


def decoder_embedder(path: str, max_seq_length: int) -> SentenceTransformer:
    """Last-token pooling over a decoder padded on the left, normalised, with the query instruction."""
    modules = st_modules()
    transformer = modules.Transformer(path, max_seq_length=max_seq_length, tokenizer_args={"padding_side": "left"})
    pooling = modules.Pooling(transformer.get_word_embedding_dimension(), pooling_mode="lasttoken")
    return SentenceTransformer(modules=[transformer, pooling, modules.Normalize()], prompts={"query": QUERY_PROMPT})


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a decoder embedder (Hub id or folder, e.g. Qwen/Qwen3-Embedding-0.6B); unset: a tiny local Qwen3",
    )
    parser.add_argument("--max-steps", type=int, default=4, help="training steps")
    parser.add_argument("--batch-size", type=int, default=16, help="pairs per step (the in-batch negatives)")
    parser.add_argument("--mini-batch-size", type=int, default=4, help="rows embedded at once by the cached loss")
    parser.add_argument("--max-seq-length", type=int, default=128, help="truncate texts to this many tokens")
    parser.add_argument("--lora-rank", type=int, default=8, help="rank of the LoRA adapter")
    parser.add_argument(
        "--target-modules",
        nargs="+",
        default=["q_proj", "k_proj", "v_proj", "o_proj"],
        help="the layers the adapter adapts",
    )
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="learning rate of the adapter")
    parser.add_argument("--output-dir", default="runs/example-decoder-lora", help="where the adapter is saved")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    pairs = stdlib_pairs()
    if args.model is None:
        texts = [QUERY_PROMPT, *(row[column] for row in pairs for column in ("anchor", "positive"))]
        model = decoder_embedder(build_tiny_qwen3(os.path.join(args.output_dir, "tiny-qwen3"), texts), 64)
    else:
        model = SentenceTransformer(args.model)
        model.tokenizer.padding_side = "left"  # the last token of every row is then the last position
        model.max_seq_length = args.max_seq_length
    prompt = model.prompts.get("query", QUERY_PROMPT)
    add_lora_adapter(
        model, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=args.target_modules)
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"LoRA adapter: {trainable:,} of {sum(p.numel() for p in model.parameters()):,} weights train")

    dimension = model.get_sentence_embedding_dimension()
    dims = [dimension, dimension // 2, dimension // 4]
    inner = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=args.mini_batch_size)
    loss = losses.MatryoshkaLoss(model, inner, dims)
    training_args = SentenceTransformerTrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        gradient_checkpointing=True,
        prompts={"anchor": prompt},
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        batch_sampler="no_duplicates",
        use_cpu=not torch.cuda.is_available(),
    )
    SentenceTransformerTrainer(
        model=model, args=training_args, train_dataset=Dataset.from_list(pairs), loss=loss
    ).train()

    saved = os.path.join(args.output_dir, "model")
    model.save(saved)
    print(f"saved the adapter: {sorted(name for name in os.listdir(saved) if name.startswith('adapter'))}")
    queries = [pairs[0]["anchor"], pairs[1]["anchor"]]
    trained = model.encode(queries, prompt=prompt, convert_to_tensor=True)
    reloaded = SentenceTransformer(saved, device=str(model.device))
    again = reloaded.encode(queries, prompt=prompt, convert_to_tensor=True)
    print(f"embeddings identical after reloading: {torch.equal(trained, again)}")


if __name__ == "__main__":
    main()
