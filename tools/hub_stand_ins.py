"""Tiny, locally built stand-ins for the Hub models that upstream's test fixtures load, in a Hub cache folder.

Upstream's tests load models such as ``sentence-transformers-testing/stsb-bert-tiny-safetensors`` from the Hub.
Offline those tests fail before and after a patch alike and prove nothing. This builds a model of the same kind
and shape (a BERT of hidden size 128 with 2 layers, random weights, a small WordPiece vocabulary; a static embedding
model of the real one's dimension, which tests check) under each id in
the layout ``huggingface_hub`` reads from its cache, so that with ``HF_HUB_CACHE`` pointing there and
``HF_HUB_OFFLINE=1`` the fixtures load them and the tests run. Tests that check a real model's outputs still fail
(before and after alike); tests of shapes, gradients and training run.

Run by the Python of the series being checked (the models are saved by its sentence-transformers):
``python hub_stand_ins.py CACHE_DIR``.
"""

from __future__ import annotations

import string
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    BertTokenizerFast,
    DistilBertConfig,
    DistilBertModel,
)

#: Any fixed 40-hex revision: the cache maps the ``main`` ref to it.
REVISION = "0" * 39 + "1"
WORDS = (
    "the a an of to and in is was for on that with as it by at from this be are or not have has what which who how "
    "when where why can will one two three man woman person people child dog cat horse car bike food water city "
    "house music game book movie sport play plays playing run runs running eat eats eating walk walks sit sits "
    "stand ride rides riding guitar piano street park field beach snow tree grass red blue green black white big "
    "small young old new good bad happy question answer query document passage sentence text word search result"
).split()


def tokenizer(folder: Path) -> BertTokenizerFast:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *string.ascii_lowercase, *string.digits]
    vocab += [f"##{char}" for char in string.ascii_lowercase + string.digits] + list(string.punctuation)
    vocab += [word for word in WORDS if word not in vocab]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), do_lower_case=True, model_max_length=512)


def bert_config(vocab_size: int, **kwargs) -> BertConfig:
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        max_position_embeddings=512,
        **kwargs,
    )


def save_transformers_model(model_class: type, config, folder: Path) -> None:
    tokenizer(folder).save_pretrained(folder)
    model_class(config).save_pretrained(folder)


def sentence_transformer(folder: Path) -> None:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Pooling, Transformer

    with tempfile.TemporaryDirectory() as raw:
        save_transformers_model(BertModel, bert_config(len(tokenizer(Path(raw)))), Path(raw))
        transformer = Transformer(raw)
        model = SentenceTransformer(modules=[transformer, Pooling(transformer.get_word_embedding_dimension())])
        model.save(str(folder))


def cross_encoder(folder: Path) -> None:
    from sentence_transformers import CrossEncoder

    with tempfile.TemporaryDirectory() as raw:
        save_transformers_model(
            BertForSequenceClassification, bert_config(len(tokenizer(Path(raw))), num_labels=1), Path(raw)
        )
        CrossEncoder(raw).save(str(folder))


def sparse_encoder(folder: Path) -> None:
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.models import MLMTransformer, SpladePooling

    with tempfile.TemporaryDirectory() as raw:
        save_transformers_model(BertForMaskedLM, bert_config(len(tokenizer(Path(raw)))), Path(raw))
        SparseEncoder(modules=[MLMTransformer(raw), SpladePooling("max")]).save(str(folder))


def static_embedding(folder: Path) -> None:
    """A ``StaticEmbedding`` model of 1024 dimensions, as ``static-retrieval-mrl-en-v1``: its tests check them."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import StaticEmbedding

    with tempfile.TemporaryDirectory() as raw:
        static = StaticEmbedding(tokenizer(Path(raw)).backend_tokenizer, embedding_dim=1024)
        SentenceTransformer(modules=[static]).save(str(folder))


def distilbert(folder: Path) -> None:
    config = DistilBertConfig(vocab_size=len(tokenizer(folder)), dim=128, n_layers=2, n_heads=2, hidden_dim=512)
    save_transformers_model(DistilBertModel, config, folder)


def bert_tokenizer(folder: Path) -> None:
    tokenizer(folder).save_pretrained(folder)


#: Hub id: how its stand-in is built. A builder that the installed sentence-transformers cannot run (e.g. no
#: SparseEncoder before 5.0) is left out, and the tests that need it fail before and after alike, as without it.
STAND_INS: dict[str, Callable[[Path], None]] = {
    "sentence-transformers-testing/stsb-bert-tiny-safetensors": sentence_transformer,
    "cross-encoder-testing/reranker-bert-tiny-gooaq-bce": cross_encoder,
    "cross-encoder-testing/reranker-bert-tiny": cross_encoder,
    # The same reranker as saved by sentence-transformers 5.4 on (modular modules.json), which save() writes there.
    "cross-encoder-testing/reranker-bert-tiny-gooaq-bce-STv54": cross_encoder,
    "sparse-encoder-testing/splade-bert-tiny-nq": sparse_encoder,
    "sentence-transformers/static-retrieval-mrl-en-v1": static_embedding,
    "distilbert/distilbert-base-uncased": distilbert,
    "google-bert/bert-base-uncased": bert_tokenizer,
}


def build(cache: Path) -> list[str]:
    """Build every stand-in under ``cache`` (a ``HF_HUB_CACHE`` folder); returns the ids built."""
    built = []
    for model_id, builder in STAND_INS.items():
        repository = cache / ("models--" + model_id.replace("/", "--"))
        snapshot = repository / "snapshots" / REVISION
        if snapshot.exists():
            built.append(model_id)
            continue
        torch.manual_seed(0)
        try:
            builder(snapshot)
        except ImportError:
            continue
        (repository / "refs").mkdir(parents=True, exist_ok=True)
        (repository / "refs" / "main").write_text(REVISION)
        built.append(model_id)
    return built


if __name__ == "__main__":
    print("\n".join(build(Path(sys.argv[1]))))
