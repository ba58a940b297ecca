"""Precomputed embeddings: encode ``datasets.Dataset`` columns once with a frozen encoder, then release it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from st_ext.offload.guards import refuse_if_released, refuse_if_trainable
from st_ext.offload.placement import on_device
from st_ext.offload.releasing import release

logger = logging.getLogger(__name__)

#: Default name of a precomputed embedding column: ``"anchor"`` → ``"anchor_guide_emb"``.
GUIDE_EMBEDDING_COLUMN_TEMPLATE = "{column}_guide_emb"


def embedding_column_name(column: str, template: str = GUIDE_EMBEDDING_COLUMN_TEMPLATE) -> str:
    """Name of the column holding the precomputed embeddings of ``column``."""
    if "{column}" not in template:
        raise ValueError(f"output_column_template must contain '{{column}}', got {template!r}.")
    return template.format(column=column)


def precompute_embeddings(
    encoder: nn.Module,
    dataset: Any,
    columns: str | Sequence[str],
    *,
    batch_size: int = 32,
    output_column_template: str = GUIDE_EMBEDDING_COLUMN_TEMPLATE,
    release_encoder: bool = False,
    holders: Iterable[Any] = (),
    optimizers: Iterable[Any] = (),
    force: bool = False,
    device: str | torch.device | None = None,
    show_progress_bar: bool = True,
    overwrite: bool = False,
    **encode_kwargs: Any,
) -> Any:
    """Encode text ``columns`` of a ``datasets.Dataset`` once; return it with embedding columns.

    Each column ``c`` gets a column ``output_column_template.format(column=c)`` (by default
    ``"c_guide_emb"``, see :func:`embedding_column_name`) holding one list of float32 per row,
    row-aligned with ``c``, computed by ``encoder.encode`` (a SentenceTransformer; extra keyword
    arguments such as ``normalize_embeddings`` go to it). Texts are encoded longest first, as
    ``encode`` does, so batches pad little.

    It embeds the raw strings (the encoder's tokenizer, its ``max_seq_length``); a loss's live frozen
    encoder embeds what the training model's tokenizer kept of them. The two agree when encoder and model
    share a tokenizer and each text fits the model's ``max_seq_length``; a guide table that equals the
    live guide in every case: ``st_ext.losses.GuideEmbeddings.from_dataset(model, guide, dataset)``.

    With ``device`` the encoder is brought there only for the encoding (:func:`on_device`). With
    ``release_encoder=True`` the encoder is released afterwards (:func:`release`, with ``holders``,
    ``optimizers`` and ``force``); whether it may be released is checked before encoding, so a refusal
    costs nothing.
    """
    column_list = [columns] if isinstance(columns, str) else list(columns)
    refuse_if_released(encoder)
    output_names = _check_precompute_input(encoder, dataset, column_list, output_column_template, overwrite)
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
    if release_encoder:
        refuse_if_trainable(encoder, optimizers=optimizers, force=force, action="release")
    placement = on_device(encoder, device, force=force) if device is not None else contextlib.nullcontext()
    from tqdm.auto import tqdm

    progress = tqdm(
        total=len(dataset) * len(column_list),
        unit="text",
        desc="Precomputing embeddings",
        disable=not show_progress_bar,
    )
    with placement, progress:
        embeddings = {
            column: _encode_column(encoder, list(dataset[column]), batch_size, progress, encode_kwargs)
            for column in column_list
        }
    for column, output_name in zip(column_list, output_names):
        if output_name in dataset.column_names:
            dataset = dataset.remove_columns(output_name)
        dataset = dataset.add_column(output_name, list(embeddings[column]))
    if release_encoder:
        report = release(encoder, holders=holders, optimizers=optimizers, force=force)
        if not report.ok:
            logger.warning("The encoder was released but not everything was freed:\n%s", report.check)
    return dataset


def _check_precompute_input(encoder, dataset, columns, template, overwrite) -> list[str]:
    """Validate before the (long) encoding; return the output column names."""
    if not callable(getattr(encoder, "encode", None)):
        raise TypeError(
            f"precompute_embeddings needs an encoder with .encode(texts) (a SentenceTransformer), "
            f"got {type(encoder).__name__}."
        )
    if not columns:
        raise ValueError("precompute_embeddings needs at least one column to encode.")
    missing = [column for column in columns if column not in dataset.column_names]
    if missing:
        raise ValueError(f"Columns {missing} are not in the dataset (it has {dataset.column_names}).")
    output_names = [embedding_column_name(column, template) for column in columns]
    clashing = [name for name in output_names if name in dataset.column_names and not overwrite]
    if clashing:
        raise ValueError(f"Output columns {clashing} already exist; pass overwrite=True to replace them.")
    for column in columns:
        for row, text in enumerate(dataset[column]):
            if not isinstance(text, str):
                raise TypeError(f"Column {column!r} row {row} is {type(text).__name__}, not a string: {text!r}.")
    return output_names


def _encode_column(encoder, texts: list[str], batch_size, progress, encode_kwargs):
    """Embeddings of one column as a float32 array, one row per dataset row."""
    import numpy as np

    order = sorted(range(len(texts)), key=lambda row: -len(texts[row]))
    result = None
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        batch = encoder.encode(
            [texts[row] for row in rows],
            batch_size=batch_size,
            convert_to_numpy=True,
            show_progress_bar=False,
            **encode_kwargs,
        )
        batch = np.asarray(batch, dtype=np.float32)
        if result is None:
            result = np.empty((len(texts), *batch.shape[1:]), dtype=np.float32)
        result[rows] = batch
        progress.update(len(rows))
    return result if result is not None else np.empty((0, 0), dtype=np.float32)
