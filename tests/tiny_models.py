"""Tiny BERT models built locally, so tests never touch the network.

A word-level vocabulary of a few hundred tokens, a `BertConfig` with small dimensions, and the
`tokenizers` library for a real fast tokenizer: the models load through the same code paths as a
Hub model (``models.Transformer(path)``, ``CrossEncoder(path)``) on every supported version.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import BertConfig, BertForSequenceClassification, BertModel, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = (
    "the a an of to in on for with and or is are was be this that it as by at from query passage "
    "document answer question model train memory batch loss cache gradient layer token sentence "
    "embedding vector search rank retrieve cat dog bird fish tree river city house car road"
).split()
VOCAB = list(dict.fromkeys(SPECIAL_TOKENS + WORDS + list(string.ascii_lowercase) + [str(d) for d in range(10)]))


def build_tokenizer(tokens: list[str] = VOCAB) -> PreTrainedTokenizerFast:
    """A lower-casing word-level tokenizer with BERT's [CLS]/[SEP] templates for single texts and pairs,
    numbering ``tokens`` (the special tokens among them) in their order."""
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls_id, sep_id = vocab["[CLS]"], vocab["[SEP]"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=64,
    )


def bert_config(num_layers: int = 2, hidden_size: int = 32, dropout: float = 0.1, num_labels: int = 1) -> BertConfig:
    return BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        intermediate_size=hidden_size * 2,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        num_labels=num_labels,
    )


def save_tiny_bert(
    path: Path, *, classifier: bool = False, seed: int = 0, tokens: list[str] = VOCAB, **config_kwargs
) -> Path:
    """Save a randomly initialised tiny BERT (encoder, or sequence classifier) with its tokenizer over
    ``tokens`` (an order of ``VOCAB``: another order is another vocabulary of the same size)."""
    torch.manual_seed(seed)
    config = bert_config(**config_kwargs)
    model = BertForSequenceClassification(config) if classifier else BertModel(config)
    model.save_pretrained(path)
    build_tokenizer(tokens).save_pretrained(path)
    return path


def sentence_transformer_from(path: Path, model_class=None, pooling_mode: str = "mean"):
    """A Transformer + Pooling SentenceTransformer over a saved tiny BERT."""
    from st_ext import SentenceTransformer
    from st_ext._compat import st_modules

    model_class = model_class or SentenceTransformer
    modules = st_modules()
    transformer = modules.Transformer(str(path), max_seq_length=32)
    pooling = modules.Pooling(transformer.get_word_embedding_dimension(), pooling_mode=pooling_mode)
    return model_class(modules=[transformer, pooling], device="cpu")


def cross_encoder_from(path: Path, model_class=None):
    """A CrossEncoder over a saved tiny BERT sequence classifier (one label)."""
    from st_ext import CrossEncoder

    model_class = model_class or CrossEncoder
    return model_class(str(path), num_labels=1, max_length=32, device="cpu")


SENTENCES = [
    "the cat is in the house",
    "a dog on the road",
    "search for the answer to this question",
    "train the model with a batch of sentences",
    "memory of the gradient cache layer",
    "the river is by the city",
    "a bird in the tree",
    "rank the passage for the query",
]
