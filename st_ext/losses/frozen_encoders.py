"""What the losses with a frozen encoder (a GIST guide, a distillation teacher) share.

A loss sees token ids, not texts, so the encoder either reads the model's ids directly (same
vocabulary, no shorter limit) or gets each row decoded and re-tokenized. Its outputs can be
computed before training (:func:`frozen_outputs`, the one way every table and label column is
computed) and looked up by each row's token ids (:class:`KeyedRows`): that equals the live encoder
exactly and needs no change to the dataset or the data collator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from st_ext import offload
from st_ext._compat import own_submodules, preprocess
from st_ext.gradient_sync import parameters_sharded
from st_ext.losses.features import Features, collator_inputs, reads_flattened, row_keys, row_token_ids, to_padded

LABEL_COLUMNS = ("label", "labels", "score", "scores", "dataset_name")


def retokenizer_for(model: nn.Module, encoder: nn.Module) -> PreTrainedTokenizerBase | None:
    """The model's tokenizer when ``encoder`` cannot read the model's token ids (another vocabulary, or a
    shorter ``max_seq_length``): each row is then decoded and re-tokenized for it. Else None."""
    model_tokenizer = getattr(model, "tokenizer", None)
    encoder_tokenizer = getattr(encoder, "tokenizer", None)
    if not isinstance(model_tokenizer, PreTrainedTokenizerBase) or not isinstance(
        encoder_tokenizer, PreTrainedTokenizerBase
    ):
        raise ValueError(
            "Both the training model and the frozen encoder (guide, teacher) must use a PreTrainedTokenizer "
            "from transformers."
        )
    model_length, encoder_length = getattr(model, "max_seq_length", None), getattr(encoder, "max_seq_length", None)
    shorter = model_length is not None and encoder_length is not None and encoder_length < model_length
    if shorter or model_tokenizer.get_vocab() != encoder_tokenizer.get_vocab():
        return model_tokenizer
    return None


def module_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def features_device(features: Features | Sequence[Features]) -> torch.device:
    first = features if isinstance(features, Mapping) else features[0]
    return next(value.device for value in first.values() if isinstance(value, Tensor))


def decoded_texts(features: Features, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The texts of a column's rows, as ``tokenizer`` decodes their ids (special tokens dropped)."""
    return tokenizer.batch_decode([ids.tolist() for ids in row_token_ids(features)], skip_special_tokens=True)


def embed_frozen(
    encoder: nn.Module, features: Features, retokenize_with: PreTrainedTokenizerBase | None, device: torch.device
) -> Tensor:
    """``encoder``'s embeddings of one batch of the model's features, returned on ``device``.

    The encoder gets its own copy of the features: modules write their outputs into the dict they
    are given, and the model's forward pass may reuse it. Flattened features are padded for an
    encoder that does not read them (say a guide without flash-attention).
    """
    encoder_device = module_device(encoder)
    if retokenize_with is not None:
        features = preprocess(encoder, decoded_texts(features, retokenize_with))
    elif not reads_flattened(encoder):
        features = to_padded(features, getattr(getattr(encoder, "tokenizer", None), "pad_token_id", None) or 0)
    features = {
        key: value.to(encoder_device) if isinstance(value, Tensor) else value for key, value in features.items()
    }
    with torch.no_grad():
        return encoder(features)["sentence_embedding"].to(device)


def frozen_outputs(
    model: nn.Module,
    encoder: nn.Module,
    columns: Sequence[Sequence[str]],
    run: Callable[[list[Features]], Tensor],
    *,
    batch_size: int = 32,
    device: str | torch.device | None = None,
    desc: str = "Frozen encoder",
    show_progress_bar: bool = True,
) -> Iterator[tuple[list[Features], Tensor]]:
    """Batches of the rows of ``columns`` (row-aligned lists of texts), each with ``run``'s outputs on the CPU.

    Every precomputed table or label column comes from here, so that it equals the live encoder: the
    training ``model`` tokenizes the rows as the data collator does, and ``run`` is what the live loss
    runs on those features. ``device``: where ``encoder`` runs for this pass (frozen, moved there and
    back); default: where it is.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
    if device is not None:
        encoder.requires_grad_(False)
    features_on = torch.device(device) if device is not None else module_device(encoder)
    num_rows = len(columns[0]) if columns else 0
    with (
        frozen_placement(encoder, device, offloaded=device is not None),
        tqdm(total=num_rows, desc=desc, disable=not show_progress_bar) as progress,
    ):
        for begin in range(0, num_rows, batch_size):
            features = [preprocess(model, list(column[begin : begin + batch_size]), features_on) for column in columns]
            yield features, run(features).cpu()
            progress.update(min(batch_size, num_rows - begin))


@contextmanager
def inputs_kept(sentence_features: Sequence[Features]) -> Iterator[None]:
    """Within the block, each column's integer tensors (the collator's token ids, masks and lengths) are
    copies; after it, the originals again.

    Upstream's Matryoshka and layer-wise wrappers call a non-cached loss once per dimension or layer
    with the same features, and the model's modules may edit their inputs in place (4.x's
    ``Pooling(include_prompt=False)`` zeroes the prompt positions of the mask). Running the model in
    this block leaves every call's frozen encoder and table lookup the rows the collator made. The
    model still gets the caller's dicts, since wrappers read its outputs from there (6.x's
    ``AdaptiveLayerLoss`` passes every layer's embeddings between calls that way).
    """
    swapped = []
    for features in sentence_features:
        originals = collator_inputs(features)
        features.update({key: value.clone() for key, value in originals.items()})
        swapped.append((features, originals))
    try:
        yield
    finally:
        for features, originals in reversed(swapped):
            features.update(originals)


def shares_parameters(first: nn.Module, second: nn.Module) -> bool:
    return not {id(p) for p in first.parameters()}.isdisjoint(id(p) for p in second.parameters())


def frozen_placement(encoder: nn.Module, device: str | torch.device | None, offloaded: bool):
    """Where a frozen encoder runs: on ``device`` just for this pass when offloaded, else where it lives."""
    if not offloaded:
        return nullcontext()
    assert device is not None, "an offloaded encoder runs where the batch is"
    return offload.on_device(encoder, device)


def text_columns(dataset: Any) -> list[str]:
    """The columns the data collator tokenizes: string-valued ones that are not labels, in order."""
    features = dataset.features
    return [
        name
        for name in dataset.column_names
        if name not in LABEL_COLUMNS and getattr(features[name], "dtype", None) in ("string", "large_string")
    ]


def as_dataset_list(datasets: Any) -> list[Any]:
    """A ``Dataset``, a ``DatasetDict``/dict of datasets, or a list of any of these, as a flat list."""
    if datasets is None:
        return []
    if hasattr(datasets, "column_names") and not isinstance(datasets.column_names, dict):
        return [datasets]
    items = datasets.values() if hasattr(datasets, "values") else datasets
    return [dataset for item in items for dataset in as_dataset_list(item)]


def combined_row_keys(sentence_features: Sequence[Features]) -> list[bytes]:
    """One key per row over every column: the rows' token ids, each column's length-prefixed."""
    per_column = [row_keys(features) for features in sentence_features]
    return [b"".join(len(key).to_bytes(4, "little") + key for key in row) for row in zip(*per_column)]


class KeyedRows:
    """Rows of a frozen encoder's output computed before training, looked up by token-id keys: a
    subclass's :meth:`keys_of` keys a guide's rows by one column's token ids, a teacher's by every column's."""

    def __init__(self, keys: dict[bytes, int], values: Tensor) -> None:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys for {len(values)} rows.")
        self.keys = keys
        self.values = values

    def __len__(self) -> int:
        return len(self.keys)

    @staticmethod
    def keys_of(features: Any, /) -> list[bytes]:
        raise NotImplementedError

    @classmethod
    def from_batches(cls, batches: Iterable[tuple[Any, Tensor]], empty: Tensor):
        """A table from ``(features, values)`` pairs, one row of ``values`` per row of ``features``; a row
        whose key the table already holds is skipped. Kept on the CPU."""
        keys: dict[bytes, int] = {}
        chunks: list[Tensor] = []
        for features, values in batches:
            new_rows = []
            for row, key in enumerate(cls.keys_of(features)):
                if key not in keys:
                    keys[key] = len(keys)
                    new_rows.append(row)
            if new_rows:
                chunks.append(values[torch.tensor(new_rows, dtype=torch.long)].cpu())
        return cls(keys, torch.cat(chunks) if chunks else empty)

    def lookup(self, features: Any) -> Tensor | None:
        """The rows of ``features`` on the features' device; None if any row is missing."""
        rows = [self.keys.get(key) for key in self.keys_of(features)]
        if any(row is None for row in rows):
            return None
        return self.values[torch.tensor(rows, dtype=torch.long)].to(features_device(features))

    def missing(self, features: Any) -> int:
        """How many rows of ``features`` the table lacks."""
        return sum(key not in self.keys for key in self.keys_of(features))

    def extended_with(self, other: KeyedRows):
        """A table with this one's rows, plus the rows of ``other`` whose keys this one lacks."""
        if len(other) and len(self) and other.values.shape[1:] != self.values.shape[1:]:
            shapes = tuple(self.values.shape[1:]), tuple(other.values.shape[1:])
            raise ValueError(f"Cannot extend a table of rows shaped {shapes[0]} with rows shaped {shapes[1]}.")
        new_keys = [key for key in other.keys if key not in self.keys]
        if not new_keys:
            return self
        keys = dict(self.keys)
        for key in new_keys:
            keys[key] = len(keys)
        added = other.values[torch.tensor([other.keys[key] for key in new_keys], dtype=torch.long)]
        return type(self)(keys, torch.cat([self.values, added.to(self.values.dtype)]) if len(self) else added)

    def save(self, path: str | Path) -> None:
        torch.save({"keys": list(self.keys), "values": self.values}, path)

    @classmethod
    def load(cls, path: str | Path):
        state = torch.load(path, weights_only=True)
        return cls({key: row for row, key in enumerate(state["keys"])}, state["values"])


class FrozenEncoderHolder(nn.Module):
    """A loss that holds one frozen encoder (``self.<encoder_attribute>``), resident or offloaded, and/or a
    table of its outputs (``self.<table_attribute>``), with what ``SentenceTransformerTrainer(frozen_encoders=...)``
    calls: :meth:`offload_frozen_encoder` and :meth:`precompute_frozen_encoder`."""

    #: The attribute holding the encoder ("guide"), the one saying whether it is offloaded, and the one
    #: holding the precomputed table ("guide_embeddings": error messages name it with spaces).
    encoder_attribute: ClassVar[str]
    offload_attribute: ClassVar[str]
    table_attribute: ClassVar[str]
    table_class: ClassVar[type[KeyedRows]]
    #: The tokenizer whose texts the encoder re-tokenizes (None: it reads the model's features as they are).
    retokenize_with: PreTrainedTokenizerBase | None

    @classmethod
    def _check_encoder_and_table(
        cls, encoder: nn.Module | None, table: KeyedRows | None, offloaded: bool, *, neither: Exception
    ) -> None:
        """Raise ``neither`` without an encoder and a table, and refuse a table of another class or an offload
        with no encoder."""
        if encoder is None and table is None:
            raise neither
        if table is not None and not isinstance(table, cls.table_class):
            raise TypeError(
                f"{cls.table_attribute} must be a {cls.table_class.__name__} table, got {type(table).__name__}."
            )
        if offloaded and encoder is None:
            raise ValueError(f"{cls.offload_attribute}=True needs a {cls.encoder_attribute} to offload.")

    def _rows_from_table(self, lookups: Sequence[Any]) -> list[Tensor] | None:
        """The table's rows of each of ``lookups`` when it holds them all; None when the live encoder must
        compute them instead (``KeyError`` when there is none)."""
        table = getattr(self, self.table_attribute)
        if table is None:
            return None
        found = [table.lookup(item) for item in lookups]
        if all(rows is not None for rows in found):
            return found
        if getattr(self, self.encoder_attribute) is None:
            missing = sum(table.missing(item) for item in lookups)
            raise KeyError(
                f"{missing} row(s) of this batch are not in the precomputed {self.table_attribute.replace('_', ' ')} "
                f"and the loss has no {self.encoder_attribute} to fall back on. Build the table from every dataset "
                "the loss sees (training and evaluation) with this model's tokenizer, max_seq_length and prompts."
            )
        return None

    def _hold_encoder(self, encoder: nn.Module | None, offloaded: bool) -> None:
        """Hold ``encoder``: as a submodule (resident, moved with the loss), or offloaded to the CPU outside
        the module tree, so that the trainer's ``loss.to(device)`` leaves it there and ``state_dict`` lacks it."""
        if offloaded:
            assert encoder is not None, "_check_encoder_and_table refuses an offload without an encoder"
            if parameters_sharded(encoder):
                raise ValueError(
                    f"{self.offload_attribute}=True (or frozen_encoders='offload') cannot move this "
                    f"{self.encoder_attribute}: its weights are sharded across ranks (DeepSpeed ZeRO-3 partitions "
                    "every model loaded after its training arguments; FSDP shards what it wraps). Keep it off the "
                    'accelerator with ZeRO\'s "offload_param": {"device": "cpu"} under "zero_optimization", or load '
                    "it before creating the training arguments to offload a whole copy."
                )
            own_submodules(self).pop(self.encoder_attribute, None)
            encoder.requires_grad_(False)
            object.__setattr__(self, self.encoder_attribute, encoder)
            offload.offload(encoder)
        else:
            setattr(self, self.encoder_attribute, encoder)
        setattr(self, self.offload_attribute, offloaded)

    def _check_can_let_go(self, encoder: nn.Module) -> None:
        """Raise if ``encoder`` may not be frozen, moved or released."""

    def _table_for(self, encoder: nn.Module, datasets: Any, **kwargs: Any) -> KeyedRows:
        raise NotImplementedError

    def offload_frozen_encoder(self) -> None:
        """From now on keep the encoder on the CPU and bring it onto the model's device only for its pass."""
        encoder = getattr(self, self.encoder_attribute)
        if encoder is None or getattr(self, self.offload_attribute):
            return
        self._check_can_let_go(encoder)
        self._hold_encoder(encoder, offloaded=True)

    def precompute_frozen_encoder(
        self,
        datasets: Any,
        *,
        device: str | torch.device | None = None,
        batch_size: int = 32,
        show_progress_bar: bool = True,
    ) -> nn.Module | None:
        """Compute the encoder's outputs for every row of ``datasets`` into a table and let go of the encoder.

        Returns the encoder (None when there was none left) for the caller to release with
        :func:`st_ext.offload.release`, once, after every loss that shares it has precomputed.
        """
        encoder = getattr(self, self.encoder_attribute)
        if encoder is None:
            return None
        self._check_can_let_go(encoder)
        table = self._table_for(
            encoder, datasets, device=device, batch_size=batch_size, show_progress_bar=show_progress_bar
        )
        held = getattr(self, self.table_attribute)
        setattr(self, self.table_attribute, table if held is None else held.extended_with(table))
        own_submodules(self).pop(self.encoder_attribute, None)
        self.__dict__.pop(self.encoder_attribute, None)
        self._hold_encoder(None, offloaded=False)
        self.retokenize_with = None
        return encoder
