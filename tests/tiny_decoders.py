"""Tiny decoder embedders built locally (Qwen3 and Qwen2), so the LoRA tests never touch the network.

A decoder embedder as Qwen3-Embedding, gte-Qwen2 and e5-mistral are trained: a causal language model's
hidden states, the last token's taken as the sentence embedding (``pooling_mode="lasttoken"``), an
end-of-text token appended to every text, padding on the left, and an instruction prompt before each query.
The model is a randomly initialised Hugging Face decoder from its config (hidden 32, 2 layers), the
tokenizer a word-level one made with the `tokenizers` library, so the model loads through
``models.Transformer(path)`` as a Hub checkpoint would on every supported version.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import VOCAB
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
DECODER_VOCAB = [END_OF_TEXT, *[token for token in VOCAB if not token.startswith("[")], "[UNK]", "instruct", ":"]
QUERY_PROMPT = "instruct: retrieve the passage for the query . query: "

#: The families the tests build, by the config class each needs from transformers.
FAMILY_CONFIGS = {"qwen3": "Qwen3Config", "qwen2": "Qwen2Config"}
FAMILIES = list(FAMILY_CONFIGS)
#: The layers the tests' LoRA adapters adapt.
LORA_TARGETS = ["q_proj", "v_proj"]


def build_decoder_tokenizer() -> PreTrainedTokenizerFast:
    """A lower-casing word-level tokenizer that appends the end-of-text token to each text (last-token pooling
    reads its hidden state) and pads on the left with that same token, as Qwen's tokenizers do."""
    vocab = {token: index for index, token in enumerate(DECODER_VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {END_OF_TEXT}",
        pair=f"$A {END_OF_TEXT} $B:1 {END_OF_TEXT}:1",
        special_tokens=[(END_OF_TEXT, vocab[END_OF_TEXT])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        pad_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        padding_side="left",
        model_max_length=64,
    )


def decoder_config(family: str, *, num_layers: int = 2, hidden_size: int = 32, dropout: float = 0.0):
    """A small config of ``family``; skips the calling test where the installed transformers lacks it."""
    config_class = getattr(transformers, FAMILY_CONFIGS[family], None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {FAMILY_CONFIGS[family]}")
    end_of_text = DECODER_VOCAB.index(END_OF_TEXT)
    return config_class(
        vocab_size=len(DECODER_VOCAB),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=128,
        attention_dropout=dropout,
        bos_token_id=end_of_text,
        eos_token_id=end_of_text,
        pad_token_id=end_of_text,
        tie_word_embeddings=False,
        use_cache=False,
    )


def save_tiny_decoder(path: Path, family: str = "qwen3", *, seed: int = 0, **config_kwargs) -> Path:
    """Save a randomly initialised tiny decoder of ``family`` (the bare model, as embedders load it) with
    its tokenizer. Written by the config's and safetensors' own writers: transformers' ``save_pretrained``
    writes on rank 0 only once a process group is up, and each rank of a distributed test builds its own."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(decoder_config(family, **config_kwargs), attn_implementation="eager")
    path.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(path / "config.json")
    save_file(model.state_dict(), path / "model.safetensors", metadata={"format": "pt"})
    build_decoder_tokenizer().save_pretrained(path)
    return path


def decoder_embedder(path: Path | str, model_class=None, *, normalize: bool = True):
    """Transformer (left padding) + last-token Pooling (+ Normalize), with a query instruction prompt."""
    from st_ext import SentenceTransformer
    from st_ext._compat import st_modules

    model_class = model_class or SentenceTransformer
    modules = st_modules()
    transformer = modules.Transformer(str(path), max_seq_length=48, tokenizer_args={"padding_side": "left"})
    pooling = modules.Pooling(transformer.get_word_embedding_dimension(), pooling_mode="lasttoken")
    stack = [transformer, pooling, *([modules.Normalize()] if normalize else [])]
    return model_class(modules=stack, device="cpu", prompts={"query": QUERY_PROMPT})


def with_query_prompt(columns: list[list[str]]) -> list[list[str]]:
    """The batch as a trainer hands it to the loss with ``prompts={"anchor": QUERY_PROMPT}``: the anchors
    carry the instruction, the passages none."""
    return [[QUERY_PROMPT + text for text in columns[0]], *columns[1:]]


def lora_config(**options):
    """The tests' peft ``LoraConfig``: random B as well as A, so the adapter changes the embeddings and every
    adapter weight gets a gradient."""
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False, **options)
