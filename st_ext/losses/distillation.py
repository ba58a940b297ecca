"""Distillation whose labels come from a teacher: live, offloaded between uses, or precomputed and released.

Upstream's ``MSELoss``, ``MarginMSELoss`` and ``DistillKLDivLoss`` read the teacher's outputs from
a label column filled beforehand. :class:`DistillationLoss` computes them per batch from a teacher
(resident, or offloaded with ``offload_teacher=True``), or looks them up in :class:`TeacherLabels`
computed before training; :func:`precompute_teacher_labels` writes them into a label column instead.

Labels follow upstream's recipes: ``MSELoss`` gets the teacher's embedding of the first column;
``MarginMSELoss`` ``score(query, positive) - score(query, negative_i)`` (one column per negative, or
a vector with one negative); ``DistillKLDivLoss`` the scores of every candidate column. A bi-encoder
teacher scores with its ``similarity_pairwise``, a ``CrossEncoder`` with ``predict`` on (query,
candidate) pairs. The teacher sees what the model's tokenizer kept of each text: the model's token
ids when it can read them, else each row decoded from them (always for a ``CrossEncoder``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from st_ext import offload
from st_ext._compat import MARGIN_MSE_TAKES_MANY_NEGATIVES, upstream_loss_class
from st_ext.losses.frozen_encoders import (
    FrozenEncoderHolder,
    KeyedRows,
    as_dataset_list,
    combined_row_keys,
    decoded_texts,
    embed_frozen,
    features_device,
    frozen_outputs,
    frozen_placement,
    inputs_kept,
    retokenizer_for,
    shares_parameters,
    text_columns,
)
from st_ext.losses.gradcache import Features

if TYPE_CHECKING:
    from sentence_transformers import CrossEncoder
    from typing_extensions import TypeIs

EMBEDDINGS, MARGINS, SCORES = "embeddings", "margins", "scores"
_LABEL_KIND_BY_LOSS = {"MSELoss": EMBEDDINGS, "MarginMSELoss": MARGINS, "DistillKLDivLoss": SCORES}


def label_kind(loss: nn.Module) -> str:
    """Which teacher output ``loss`` reads: ``"embeddings"``, ``"margins"`` or ``"scores"``."""
    for name, kind in _LABEL_KIND_BY_LOSS.items():
        upstream_class = upstream_loss_class(name)
        if upstream_class is not None and isinstance(loss, upstream_class):
            return kind
    supported = ", ".join(name for name in _LABEL_KIND_BY_LOSS if upstream_loss_class(name) is not None)
    raise TypeError(f"DistillationLoss supports {supported}; got {type(loss).__name__}.")


def is_cross_encoder(teacher: Any) -> TypeIs[CrossEncoder]:
    from sentence_transformers import CrossEncoder

    return isinstance(teacher, CrossEncoder)


def student_of(loss: nn.Module) -> nn.Module:
    """The model the wrapped loss trains: upstream's losses hold it as ``model``."""
    return cast(nn.Module, loss.model)


def check_teacher_kind(teacher: nn.Module, loss: nn.Module, kind: str) -> None:
    """Raise unless ``teacher`` can give the labels ``loss`` reads."""
    if is_cross_encoder(teacher):
        if kind == EMBEDDINGS:
            raise TypeError(f"{type(loss).__name__} learns the teacher's embeddings; a CrossEncoder teacher has none.")
        if getattr(teacher, "num_labels", 1) != 1:
            raise ValueError(
                f"A CrossEncoder teacher must give one score per pair; this one has num_labels={teacher.num_labels}."
            )
    elif not callable(getattr(teacher, "similarity_pairwise", None)):
        raise TypeError(f"The teacher must be a SentenceTransformer or a CrossEncoder, got {type(teacher).__name__}.")


def labels_from_scores(kind: str, scores: Tensor) -> Tensor:
    """``scores[:, i]`` = teacher score of (query, candidate i) → the labels ``kind`` wants."""
    if kind == SCORES:
        return scores
    margins = scores[:, :1] - scores[:, 1:]
    return margins.squeeze(1) if margins.shape[1] == 1 else margins


def cross_encoder_scores(teacher: CrossEncoder, columns: Sequence[Sequence[str]]) -> Tensor:
    """``(rows, candidates)`` scores of a CrossEncoder teacher on (column 0, column i) pairs."""
    queries = columns[0]
    scores = [
        torch.as_tensor(
            teacher.predict(
                list(zip(queries, candidates)),
                batch_size=max(len(queries), 1),
                convert_to_tensor=True,
                show_progress_bar=False,
            )
        ).reshape(len(queries), -1)[:, 0]
        for candidates in columns[1:]
    ]
    return torch.stack(scores, dim=1).float()


def teacher_labels_from_features(
    teacher: nn.Module, kind: str, sentence_features: Sequence[Features], retokenize_with
) -> Tensor:
    """The teacher's labels of one batch of the model's features (decoded by :func:`teacher_retokenizer`'s
    answer), on the features' device."""
    device = features_device(sentence_features[0])
    with torch.no_grad():
        if is_cross_encoder(teacher):
            texts = [decoded_texts(features, retokenize_with) for features in sentence_features]
            return labels_from_scores(kind, cross_encoder_scores(teacher, texts)).to(device)
        if kind == EMBEDDINGS:
            return embed_frozen(teacher, sentence_features[0], retokenize_with, device)
        query, *candidates = [
            embed_frozen(teacher, features, retokenize_with, device) for features in sentence_features
        ]
        similarity_pairwise = cast(Callable[[Tensor, Tensor], Tensor], teacher.similarity_pairwise)
        scores = torch.stack([similarity_pairwise(query, other) for other in candidates], dim=1)
        return labels_from_scores(kind, scores.to(device))


def teacher_retokenizer(model: nn.Module, teacher: nn.Module):
    """Who decodes the model's rows for ``teacher``: the model's tokenizer for a CrossEncoder (it scores
    texts), else :func:`retokenizer_for`'s answer."""
    return getattr(model, "tokenizer", None) if is_cross_encoder(teacher) else retokenizer_for(model, teacher)


def _check_columns(kind: str, num_columns: int) -> None:
    if kind != EMBEDDINGS and num_columns < 2:
        raise ValueError(
            f"Teacher {kind} need (query, candidate_1, ...) columns; this batch has {num_columns} text column(s)."
        )
    if kind == MARGINS and num_columns != 3 and not MARGIN_MSE_TAKES_MANY_NEGATIVES:
        raise ValueError(
            f"This sentence-transformers' MarginMSELoss takes (query, positive, negative) columns; got {num_columns}. "
            "Keep one negative column, or use sentence-transformers 5.0 or newer for several."
        )


class TeacherLabels(KeyedRows):
    """A teacher's labels for every row of some datasets, computed once and looked up by the rows' token ids.

    ::

        table = TeacherLabels.from_dataset(model, teacher, inner_loss, [train_dataset, eval_dataset], device="cuda")
        st_ext.offload.release(teacher)
        loss = DistillationLoss(inner_loss, teacher_labels=table)
    """

    #: A batch's rows, each keyed by its token ids in every column.
    keys_of = staticmethod(combined_row_keys)

    def __repr__(self) -> str:
        return f"TeacherLabels({len(self)} rows, shape={tuple(self.values.shape[1:])})"

    @classmethod
    def from_dataset(
        cls,
        model: nn.Module,
        teacher: nn.Module,
        loss: nn.Module,
        datasets: Any,
        *,
        batch_size: int = 32,
        device: str | torch.device | None = None,
        show_progress_bar: bool = True,
    ) -> TeacherLabels:
        """Label every row of one or more datasets (a ``Dataset``, ``DatasetDict`` or list) as the live loss would.

        The text columns are taken in order, as the data collator takes them. The teacher is frozen
        (``requires_grad_(False)``, ``eval()``). ``device``: where it runs for this pass (moved there
        and back); default: where it is.
        """
        options = {"batch_size": batch_size, "device": device, "show_progress_bar": show_progress_bar}
        check_teacher_kind(teacher, loss, label_kind(loss))  # also when there is no dataset to label
        batches = (
            batch
            for dataset in as_dataset_list(datasets)
            for batch in teacher_label_batches(
                model, teacher, loss, [dataset[column] for column in text_columns(dataset)], **options
            )
        )
        return cls.from_batches(batches, empty=torch.empty(0))


def teacher_label_batches(
    model: nn.Module, teacher: nn.Module, loss: nn.Module, columns: Sequence[Sequence[str]], **options: Any
) -> Iterator[tuple[list[Features], Tensor]]:
    """Batches of the rows of ``columns`` with the labels the live :class:`DistillationLoss` computes for
    them (``options``: those of :func:`~st_ext.losses.frozen_encoders.frozen_outputs`)."""
    kind = label_kind(loss)
    _check_columns(kind, len(columns))
    check_teacher_kind(teacher, loss, kind)
    teacher.requires_grad_(False).eval()
    label = partial(teacher_labels_from_features, teacher, kind, retokenize_with=teacher_retokenizer(model, teacher))
    return frozen_outputs(model, teacher, columns, label, desc="Teacher labels", **options)


class DistillationLoss(FrozenEncoderHolder, nn.Module):
    """``MSELoss``, ``MarginMSELoss`` or ``DistillKLDivLoss`` with its labels from a teacher, not the dataset.

    Args:
        loss: the upstream distillation loss (its model is the student).
        teacher: a frozen ``SentenceTransformer`` (any of the three losses) or ``CrossEncoder``
            (``MarginMSELoss``, ``DistillKLDivLoss``). It is frozen here (``requires_grad_(False)``, ``eval()``).
        teacher_labels: a :class:`TeacherLabels` table computed before training. With
            ``teacher=None`` no teacher is held during training; with a teacher too, rows that are
            not in the table (e.g. evaluation) use the live teacher.
        offload_teacher: keep the teacher on the CPU and move it onto the training device only for
            its no-grad pass in each step.

    The dataset must have no label column: the labels come from the teacher.

    References:
        - MarginMSE (cross-architecture distillation): https://huggingface.co/papers/2010.02666
        - Making monolingual sentence embeddings multilingual (MSE): https://huggingface.co/papers/2004.09813

    Inputs:
        +---------------------------------------------+-------------------------+--------+
        | Wrapped loss                                | Texts                   | Labels |
        +=============================================+=========================+========+
        | ``MSELoss``                                 | sentence_1, ... (the    | none   |
        |                                             | teacher embeds the      |        |
        |                                             | first; all learn it)    |        |
        +---------------------------------------------+-------------------------+--------+
        | ``MarginMSELoss``                           | (query, positive,       | none   |
        |                                             | negative_1, ...)        |        |
        +---------------------------------------------+-------------------------+--------+
        | ``DistillKLDivLoss`` (5.x or newer)         | (query, positive,       | none   |
        |                                             | negative_1, ...)        |        |
        +---------------------------------------------+-------------------------+--------+

    Example:
        ::

            from datasets import Dataset
            from st_ext import CrossEncoder, SentenceTransformer, SentenceTransformerTrainer, losses

            student = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
            teacher = CrossEncoder("cross-encoder/ms-marco-MiniLM-L6-v2")
            train_dataset = Dataset.from_dict({
                "query": ["what is the capital of France?"],
                "positive": ["Paris is the capital of France."],
                "negative": ["Berlin is the capital of Germany."],
            })
            loss = losses.DistillationLoss(losses.MarginMSELoss(student), teacher, offload_teacher=True)
            SentenceTransformerTrainer(model=student, train_dataset=train_dataset, loss=loss).train()
    """

    encoder_attribute = "teacher"
    offload_attribute = "offload_teacher"
    table_attribute = "teacher_labels"
    table_class = TeacherLabels

    teacher: nn.Module | None
    offload_teacher: bool
    teacher_labels: TeacherLabels | None

    def __init__(
        self,
        loss: nn.Module,
        teacher: nn.Module | None = None,
        *,
        teacher_labels: TeacherLabels | None = None,
        offload_teacher: bool = False,
    ) -> None:
        super().__init__()
        self.kind = label_kind(loss)
        neither = ValueError(
            "DistillationLoss needs a teacher model, or precomputed teacher_labels with teacher=None."
        )
        self._check_encoder_and_table(teacher, teacher_labels, offload_teacher, neither=neither)
        if teacher is not None:
            if shares_parameters(student_of(loss), teacher):
                raise ValueError(
                    "The teacher shares parameters with the student being trained; use a separate teacher model."
                )
            check_teacher_kind(teacher, loss, self.kind)
            teacher.requires_grad_(False).eval()
        self.loss = loss
        self._hold_encoder(teacher, offloaded=offload_teacher)
        self.teacher_labels = teacher_labels
        self.retokenize_with = None if teacher is None else teacher_retokenizer(student_of(loss), teacher)

    @property
    def model(self) -> nn.Module:
        return student_of(self.loss)

    def forward(self, sentence_features: Iterable[Features], labels: Tensor | None = None) -> Tensor:
        sentence_features = list(sentence_features)
        if labels is not None:
            raise ValueError(
                "This batch has labels from the dataset, but DistillationLoss computes them with its teacher. "
                "Remove the label column (dataset.remove_columns('label')), or use the bare "
                f"{type(self.loss).__name__} to train on the dataset's labels."
            )
        _check_columns(self.kind, len(sentence_features))
        labels = self.teacher_outputs(sentence_features)
        with inputs_kept(sentence_features):
            return self.loss(sentence_features, labels)

    def teacher_outputs(self, sentence_features: list[Features]) -> Tensor:
        """The batch's labels: from the table when it holds every row, else from the live teacher."""
        looked_up = self._rows_from_table([sentence_features])
        if looked_up is not None:
            return looked_up[0]
        teacher = self.teacher
        assert teacher is not None, "_rows_from_table raises when neither the table nor a teacher has the rows"
        with frozen_placement(teacher, features_device(sentence_features[0]), self.offload_teacher):
            return teacher_labels_from_features(teacher, self.kind, sentence_features, self.retokenize_with)

    def _table_for(self, encoder: nn.Module, datasets: Any, **kwargs: Any) -> TeacherLabels:
        return TeacherLabels.from_dataset(self.model, encoder, self.loss, datasets, **kwargs)

    def get_config_dict(self) -> dict[str, Any]:
        """The wrapped loss and its parameters, the teacher (as upstream's GIST cards list their guide),
        and ``teacher_labels``/``offload_teacher`` only when they are in use."""
        wrapped_config = getattr(self.loss, "get_config_dict", None)
        config = wrapped_config() if wrapped_config is not None else {}
        config = {"loss": type(self.loss).__name__, **config, "teacher": self.teacher}
        if self.teacher_labels is not None:
            config["teacher_labels"] = repr(self.teacher_labels)
        if self.offload_teacher:
            config["offload_teacher"] = True
        return config

    @property
    def citation(self) -> str | None:
        return getattr(self.loss, "citation", None)


def precompute_teacher_labels(
    teacher: nn.Module,
    dataset: Any,
    loss: nn.Module,
    *,
    columns: Sequence[str] | None = None,
    label_column: str = "label",
    batch_size: int = 32,
    device: str | torch.device | None = None,
    release_teacher: bool = False,
    holders: Iterable[Any] = (),
    show_progress_bar: bool = True,
    overwrite: bool = False,
) -> Any:
    """Return ``dataset`` with the teacher's labels for ``loss`` in ``label_column``.

    The upstream way to distil: train on the result with the bare ``loss``. Each row's label is what
    ``DistillationLoss(loss, teacher)`` would compute live: the teacher sees what the student's tokenizer
    kept of the texts, not the raw strings. ``columns`` defaults to the text columns
    in order (query first). The teacher is frozen; with ``release_teacher=True`` it is released
    afterwards (:func:`st_ext.offload.release` with ``holders``); with ``device`` it is moved there
    only for the computation. The input dataset is not changed.
    """
    columns = list(columns) if columns is not None else text_columns(dataset)
    missing = [column for column in columns if column not in dataset.column_names]
    if missing:
        raise ValueError(f"Columns {missing} are not in the dataset (it has {dataset.column_names}).")
    if label_column in dataset.column_names and not overwrite:
        raise ValueError(f"The dataset already has a {label_column!r} column; pass overwrite=True to replace it.")
    texts = [dataset[column] for column in columns]
    options = {"batch_size": batch_size, "device": device, "show_progress_bar": show_progress_bar}
    batches = teacher_label_batches(student_of(loss), teacher, loss, texts, **options)
    chunks = [labels for _, labels in batches]
    labels = torch.cat(chunks) if chunks else torch.empty(0)
    if label_column in dataset.column_names:
        dataset = dataset.remove_columns(label_column)
    dataset = dataset.add_column(label_column, labels.tolist())
    if release_teacher:
        offload.release(teacher, holders=holders)
    return dataset
