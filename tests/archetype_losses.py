"""sentence-transformers' own cached losses, one per archetype, as users build them: shared by
``tests/test_upstream_forwards.py`` (one process) and ``tests/distributed_worker.py`` (two ranks).

Every model has dropout 0, so that a step is a deterministic function of the weights and the batch and
two engines that cut the batch into different mini-batches agree to float32 round-off. The CrossEncoder
loss pairs each anchor with every in-batch negative (``num_negatives=None``): drawing them would make the
pairs depend on each rank's random state.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tiny_models import WORDS, bert_config, build_tokenizer, save_tiny_bert
from transformers import BertForMaskedLM

from st_ext import _compat
from st_ext._compat import archetype_loss_class, cross_encoder_scores_features

#: Three mini-batches per column of a rank's 8 rows, the last one short.
MINI_BATCH_SIZE = 3
ROWS = 32  # four batches of 8


def texts(count: int, seed: int) -> list[str]:
    """Distinct sentences over the tiny vocabulary (a duplicate would be a masked in-batch negative)."""
    rng = random.Random(seed)
    found: dict[str, None] = {}
    while len(found) < count:
        found[" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))] = None
    return list(found)


def save_case_models(root: Path) -> dict[str, Path]:
    """The tiny BERT encoder, sequence classifier and masked LM, all with dropout 0."""
    torch.manual_seed(0)
    mlm = root / "mlm"
    BertForMaskedLM(bert_config(dropout=0.0)).save_pretrained(mlm)
    build_tokenizer().save_pretrained(mlm)
    return {
        "encoder": save_tiny_bert(root / "encoder", dropout=0.0),
        "classifier": save_tiny_bert(root / "classifier", classifier=True, dropout=0.0),
        "mlm": mlm,
    }


@dataclass(frozen=True)
class ArchetypeCase:
    """``archetype``'s model over ``model_dir``, ``loss_name`` from ``loss_module`` built by ``build``, and the
    steps of upstream's own engine that st_ext's never runs."""

    archetype: str
    model_dir: str
    loss_module: str
    loss_name: str
    build: Callable
    upstream_engine_steps: tuple[str, ...]

    def loss_class(self) -> type | None:
        if self.archetype == "SentenceTransformer":  # sentence_transformers.losses on every release
            return _compat.upstream_loss_class(self.loss_name)
        return archetype_loss_class(self.loss_module, self.loss_name)

    def missing(self) -> str | None:
        """Why the installed sentence-transformers cannot run this case on st_ext's engine; None if it can."""
        error = _compat.missing_archetype_error(self.archetype)
        if error is not None:
            return str(error)
        loss_class = self.loss_class()
        if loss_class is None:
            return f"sentence-transformers {_compat.ST_VERSION} has no {self.loss_name}"
        if self.archetype == "CrossEncoder" and not cross_encoder_scores_features(loss_class):
            return (
                f"sentence-transformers {_compat.ST_VERSION}'s CrossEncoder {self.loss_name} calls the classifier on raw "
                "pairs inside itself: st_ext's trainers run its own forward (refused under DeepSpeed)"
            )
        return None

    def batch(self, model) -> tuple[list, torch.Tensor | None]:
        """One 8-row batch as the trainer hands it to the loss: tokenized columns (raw texts for a CrossEncoder)."""
        columns = [texts(8, seed=7), texts(8, seed=8)]
        if self.archetype == "CrossEncoder":
            return columns, None
        if self.archetype == "MultiVectorEncoder":
            tasks = ("query", "document")
            return [
                {**model.preprocess(column, task=task), "task": task} for column, task in zip(columns, tasks)
            ], None
        return [_compat.preprocess(model, column) for column in columns], None


def _ranking(loss_class, model, **settings):
    return loss_class(model, **settings)


def _splade(loss_class, model, **settings):
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss

    return loss_class(
        model, SparseMultipleNegativesRankingLoss(model), document_regularizer_weight=3e-3,
        query_regularizer_weight=5e-3, **settings,
    )  # fmt: skip


def _cross_encoder(loss_class, model, **settings):
    return loss_class(model, num_negatives=None, **settings)


CASES = {
    "sentence_transformer_cmnrl": ArchetypeCase(
        "SentenceTransformer", "encoder", "sentence_transformer", "CachedMultipleNegativesRankingLoss", _ranking,
        ("embed_minibatch_iter",),
    ),
    "splade": ArchetypeCase(
        "SparseEncoder", "mlm", "sparse_encoder", "CachedSpladeLoss", _splade, ("embed_minibatch_iter", "forward_cached"),
    ),
    "cross_encoder_cmnrl": ArchetypeCase(
        "CrossEncoder", "classifier", "cross_encoder", "CachedMultipleNegativesRankingLoss", _cross_encoder,
        ("predict_minibatch_iter",),
    ),
    "multi_vector_cmnrl": ArchetypeCase(
        "MultiVectorEncoder", "encoder", "multi_vector_encoder", "CachedMultiVectorMultipleNegativesRankingLoss",
        _ranking, ("embed_minibatch_iter",),
    ),
}  # fmt: skip


def case_model(name: str, model_dirs: dict[str, Path]):
    """A fresh upstream model of the case's archetype; a module the checkpoint lacks (the multi-vector
    projection) is initialised from a fixed seed, so that every copy starts from the same weights."""
    import sentence_transformers

    torch.manual_seed(0)
    case = CASES[name]
    path = str(model_dirs[case.model_dir])
    if case.archetype == "SentenceTransformer":
        from tiny_models import sentence_transformer_from

        return sentence_transformer_from(Path(path), model_class=sentence_transformers.SentenceTransformer)
    if case.archetype == "CrossEncoder":
        return sentence_transformers.CrossEncoder(path, num_labels=1, max_length=32, device="cpu")
    return getattr(sentence_transformers, case.archetype)(path, device="cpu")


def case_loss(name: str, model, mini_batch_size=MINI_BATCH_SIZE):
    case = CASES[name]
    return case.build(case.loss_class(), model, mini_batch_size=mini_batch_size)


def case_dataset(name: str, rows: int = ROWS, seed: int = 1):
    """(anchor, positive) rows; a CrossEncoder's as (query, answer)."""
    from datasets import Dataset

    first, second = ("query", "answer") if CASES[name].archetype == "CrossEncoder" else ("anchor", "positive")
    return Dataset.from_dict({first: texts(rows, seed=seed), second: texts(rows, seed=seed + 100)})
