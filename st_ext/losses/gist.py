"""GIST losses, cached and not, whose guide can live off the accelerator, be replaced by a precomputed table,
or be the model itself.

GISTEmbed (https://huggingface.co/papers/2402.16829) drops in-batch negatives that a frozen guide
rates as more similar to the anchor than its own positive. The guide only runs without grad, so it
can stay on the CPU between passes (``offload_guide=True``, held outside the loss's module tree so
that ``loss.to(device)`` leaves it there), or be replaced by a :class:`GuideEmbeddings` table keyed
by each row's token ids, which needs no change to the dataset or the data collator. With
``guide=model`` the model guides itself: its own embeddings of the step, detached, decide which
candidates are false negatives (the Qwen3-Embedding and pplx-embed recipes, with a negative
``margin``), without a second forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from st_ext import offload
from st_ext._compat import all_gather_with_grad, get_rank, preprocess, st_losses
from st_ext.losses._signatures import card_config, follows_upstream_signature, named_like_upstream
from st_ext.losses.auto_mini_batch import make_auto_mini_batch
from st_ext.losses.chunked_backward import backward_from_leaves, chunk_leaves, chunk_value
from st_ext.losses.features import layout_of, slice_rows
from st_ext.losses.frozen_encoders import (
    FrozenEncoderHolder,
    KeyedRows,
    as_dataset_list,
    embed_frozen,
    features_device,
    frozen_outputs,
    frozen_placement,
    inputs_kept,
    retokenizer_for,
    shares_parameters,
    text_columns,
)
from st_ext.losses.gathering import gather_from_ranks
from st_ext.losses.gradcache import (
    CachedLoss,
    Features,
    LossStep,
    Ranges,
    Reps,
    batch_size_of,
    chunked_rows,
    described,
    embeds_with_static_embedding,
    gradcache_forward,
    row_keys,
)
from st_ext.losses.overrides import upstream_hook_overrides
from st_ext.losses.same_document import DocumentIds, StepDocumentIds, check_document_ids, without_same_document

if TYPE_CHECKING:  # upstream's losses as 6.x places them; at run time, the installed release's
    from sentence_transformers.sentence_transformer import losses as _upstream
else:
    _upstream = st_losses()


# ---------------------------------------------------------------------------------------------
# The guide's no-grad pass


def guide_pass(
    guide: nn.Module,
    sentence_features: Sequence[Features],
    ranges: Sequence[Ranges],
    retokenize_with: PreTrainedTokenizerBase | None,
    *,
    offloaded: bool = False,
    show_progress_bar: bool = False,
) -> Reps:
    """The guide's embeddings of every column, mini-batch by mini-batch, in one visit to the device."""
    device = features_device(sentence_features[0])
    layouts = [layout_of(features) for features in sentence_features]
    with frozen_placement(guide, device, offloaded):
        return [
            [
                embed_frozen(guide, slice_rows(features, begin, end, layout), retokenize_with, device)
                for begin, end in tqdm(column_ranges, desc="Guide mini-batches", disable=not show_progress_bar)
            ]
            for features, layout, column_ranges in zip(sentence_features, layouts, ranges)
        ]


# ---------------------------------------------------------------------------------------------
# Precomputed guide embeddings


class GuideEmbeddings(KeyedRows):
    """Guide embeddings computed once before training, looked up by each row's token ids.

    Build it with :meth:`from_dataset` (or :meth:`from_texts`) from the model and guide the loss
    would use, pass it as ``guide_embeddings=table`` with ``guide=None``, and drop the guide. The
    trainer's collator must tokenize as ``model`` does here (same ``max_seq_length``, prompts already
    in the texts). A row missing from the table raises ``KeyError``, or uses the live guide if any::

        table = GuideEmbeddings.from_dataset(model, guide, [train_dataset, eval_dataset], device="cuda")
        st_ext.offload.release(guide)  # no guide in memory during training
        loss = CachedGISTEmbedLoss(model, guide_embeddings=table, mini_batch_size=64)
    """

    #: A column's rows, each keyed by its own token ids.
    keys_of = staticmethod(row_keys)

    @property
    def embeddings(self) -> Tensor:
        return self.values

    def __repr__(self) -> str:
        return f"GuideEmbeddings({len(self)} rows, dim={self.values.shape[-1]})"

    @classmethod
    def from_texts(
        cls,
        model: nn.Module,
        guide: nn.Module,
        texts: Iterable[str],
        *,
        batch_size: int = 32,
        device: str | torch.device | None = None,
        show_progress_bar: bool = True,
    ) -> GuideEmbeddings:
        """Embed every distinct text as the live loss would embed its row (see :func:`frozen_outputs`).

        ``device``: where the guide runs for this pass (frozen, moved there and back); default: where it is.
        """
        retokenize_with = retokenizer_for(model, guide)

        def embed(features: list[Features]) -> Tensor:
            return embed_frozen(guide, features[0], retokenize_with, features_device(features))

        options: dict[str, Any] = {"batch_size": batch_size, "device": device, "show_progress_bar": show_progress_bar}
        batches = frozen_outputs(model, guide, [list(dict.fromkeys(texts))], embed, desc="Guide embeddings", **options)
        return cls.from_batches(((features[0], values) for features, values in batches), empty=torch.empty(0, 0))

    @classmethod
    def from_dataset(
        cls,
        model: nn.Module,
        guide: nn.Module,
        datasets: Any,
        columns: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> GuideEmbeddings:
        """Embed the text columns of one or more datasets (a ``Dataset``, ``DatasetDict`` or list).

        ``columns`` defaults to every string column; label columns are never embedded.
        """
        texts: list[str] = []
        for dataset in as_dataset_list(datasets):
            for column in columns or text_columns(dataset):
                texts.extend(dataset[column])
        return cls.from_texts(model, guide, texts, **kwargs)

    @classmethod
    def from_precomputed(
        cls,
        model: nn.Module,
        dataset: Any,
        columns: Sequence[str] | None = None,
        *,
        template: str = offload.GUIDE_EMBEDDING_COLUMN_TEMPLATE,
        batch_size: int = 256,
    ) -> GuideEmbeddings:
        """A table from a dataset that :func:`st_ext.offload.precompute_embeddings` filled.

        ``columns``: the text columns whose ``template`` embedding columns to use (default: every
        text column that has one). Train on the dataset without the embedding columns: the data
        collator would try to tokenize them. The table holds the guide's ``encode`` of the raw
        strings, while the live guide embeds what the model's tokenizer kept of them: the two agree
        only when guide and model share a tokenizer and no text is truncated differently
        (:meth:`from_dataset` always equals the live guide).
        """
        if columns is None:
            present = set(dataset.column_names)
            columns = [c for c in text_columns(dataset) if offload.embedding_column_name(c, template) in present]
        if not columns:
            raise ValueError(f"No text column of {dataset.column_names} has a precomputed {template!r} column.")

        def batches():
            for column in columns:
                texts = dataset[column]
                precomputed = dataset[offload.embedding_column_name(column, template)]
                embeddings = torch.as_tensor(np.asarray(precomputed, dtype=np.float32))
                for begin in range(0, len(texts), batch_size):
                    yield preprocess(model, texts[begin : begin + batch_size]), embeddings[begin : begin + batch_size]

        return cls.from_batches(batches(), empty=torch.empty(0, 0))


# ---------------------------------------------------------------------------------------------
# The loss over embeddings


def _suppress(scores: Tensor, guide_scores: Tensor, limit: Tensor) -> Tensor:
    """``scores`` with -inf where the guide rates a candidate above the row's limit (a false negative)."""
    return scores.masked_fill(guide_scores > limit, -math.inf)


def gist_loss(
    reps: Reps,
    guide_reps: Reps | None,
    *,
    temperature: float,
    margin_strategy: str,
    margin: float,
    contrast_anchors: bool,
    contrast_positives: bool,
    chunk_size: int,
    with_backward: bool,
    gather_across_devices: bool = False,
    show_progress_bar: bool = False,
    document_ids: list[Tensor] | None = None,
) -> Tensor:
    """GISTEmbed's cross-entropy over (anchor, positive, negative_1..n) embeddings, ``chunk_size`` rows at a time.

    Scores are cosine similarities computed as products of unit vectors, so a chunk costs
    ``chunk_size x batch`` memory per block (a broadcast cosine would cost ``x dim`` more). A separate
    guide's scores are never truncated: Matryoshka only transforms ``reps``. ``guide_reps=None``: the
    model guides itself with ``reps``, detached, so its guide is what the loss scores: truncated at a
    Matryoshka dimension, a layer's own embeddings under a layer-wise loss. With ``document_ids`` (per
    column, each row's document keys), candidates from a row's own document are masked too
    (:mod:`st_ext.losses.same_document`).
    """
    guide_columns = len(reps) if guide_reps is None else len(guide_reps)
    if len(reps) < 2 or len(reps) != guide_columns:
        raise ValueError(
            f"GIST needs (anchor, positive, negative_1..n) columns with a guide embedding each; got {len(reps)} "
            f"columns and {guide_columns} guide columns."
        )
    model_side = [torch.cat(column) for column in reps]
    guide_side = None if guide_reps is None else [torch.cat(column).to(model_side[0].device) for column in guide_reps]
    batch_size = len(model_side[0])
    offset = 0
    if gather_across_devices:
        gather = all_gather_with_grad()
        assert gather is not None, "the losses refuse gather_across_devices where upstream lacks all_gather_with_grad"
        model_side = model_side[:1] + [gather(candidate) for candidate in model_side[1:]]
        if guide_side is not None:
            guide_side = guide_side[:1] + [gather(candidate) for candidate in guide_side[1:]]
        offset = get_rank() * batch_size
    # Each column's keys, gathered with its embeddings (the anchors stay on their rank); None: nothing masked.
    column_ids: list[Tensor | None] = [None] * len(reps)
    if document_ids is not None:
        gathered = [gather_from_ranks(ids) if gather_across_devices else ids for ids in document_ids[1:]]
        column_ids = [document_ids[0], *gathered]
    # Scores in fp32 whatever the autocast: bf16 similarities over a temperature of 0.05 move the
    # gradients, and can flip which candidates the guide suppresses (upstream's cosine stays fp32 too).
    model_side = [tensor.float() for tensor in model_side]
    # A model guiding itself reads the candidates it just gathered: no second gather.
    guide_side = [tensor.detach() for tensor in model_side] if guide_side is None else [t.float() for t in guide_side]
    with torch.autocast(model_side[0].device.type, enabled=False):
        graph_ends = [F.normalize(tensor, p=2, dim=-1, eps=1e-8) for tensor in model_side]
        # Back-propagating chunk by chunk, every chunk's backward ends at leaves detached from the unit
        # vectors; one final backward takes their summed gradient through the normalisation (and any
        # all-gather), which a per-chunk backward would free early.
        leaves = chunk_leaves(graph_ends, with_backward)
        anchors, *candidates = leaves
        guide_anchors, *guide_candidates = [F.normalize(tensor, p=2, dim=-1, eps=1e-8) for tensor in guide_side]
        positives, guide_positives = candidates[0], guide_candidates[0]

        total = torch.zeros((), device=anchors.device)
        for begin, end in tqdm(
            list(chunked_rows(batch_size, chunk_size)), desc="Calculating loss", disable=not show_progress_bar
        ):
            rows = torch.arange(end - begin, device=anchors.device)
            targets = offset + begin + rows
            guide_ap = guide_anchors[begin:end] @ guide_positives.T
            threshold = guide_ap[rows, targets].unsqueeze(1)
            limit = threshold - margin if margin_strategy == "absolute" else threshold - threshold.abs() * margin
            guide_ap[rows, targets] = -math.inf  # a row's own positive is never suppressed (threshold is a copy)
            row_ids = None if document_ids is None else document_ids[0][begin:end]

            ap = _suppress(anchors[begin:end] @ positives.T, guide_ap, limit)
            blocks = [without_same_document(ap, row_ids, column_ids[1], keep=(rows, targets))]
            if contrast_anchors:
                guide_aa = guide_anchors[begin:end] @ guide_anchors.T
                aa = _suppress(anchors[begin:end] @ anchors.T, guide_aa, limit)
                blocks.append(without_same_document(aa, row_ids, column_ids[0]))
            if contrast_positives:
                own = slice(offset + begin, offset + end)
                guide_pp = guide_positives[own] @ guide_positives.T
                pp = _suppress(positives[own] @ positives.T, guide_pp, limit)
                blocks.append(without_same_document(pp, row_ids, column_ids[1]))
            for negatives, guide_negatives, negative_ids in zip(candidates[1:], guide_candidates[1:], column_ids[2:]):
                guide_an = guide_anchors[begin:end] @ guide_negatives.T
                an = _suppress(anchors[begin:end] @ negatives.T, guide_an, limit)
                blocks.append(without_same_document(an, row_ids, negative_ids))

            scores = torch.cat(blocks, dim=1) / temperature
            chunk_loss = F.cross_entropy(scores, targets) * (end - begin) / batch_size
            total = total + chunk_value(chunk_loss, with_backward)

        if with_backward:
            backward_from_leaves(graph_ends, leaves)
        return total


# ---------------------------------------------------------------------------------------------
# The losses


class GuidedLoss(FrozenEncoderHolder, nn.Module):
    """What both GIST losses share: their options, and where the guide embeddings come from."""

    encoder_attribute = "guide"
    offload_attribute = "offload_guide"
    table_attribute = "guide_embeddings"
    table_class = GuideEmbeddings

    guide: nn.Module | None
    offload_guide: bool
    guide_embeddings: GuideEmbeddings | None
    show_progress_bar: bool

    def _set_up(
        self,
        model: nn.Module,
        guide: nn.Module | None,
        *,
        temperature: float,
        margin_strategy: str,
        margin: float,
        contrast_anchors: bool,
        contrast_positives: bool,
        gather_across_devices: bool,
        guide_embeddings: GuideEmbeddings | None,
        offload_guide: bool,
    ) -> None:
        # TypeError without guide and table, as upstream's missing `guide` argument raises.
        neither = TypeError(
            "A GIST loss needs a guide model, or precomputed guide_embeddings with guide=None "
            "(or the model itself as its guide: guide=model)."
        )
        self._check_encoder_and_table(guide, guide_embeddings, offload_guide, neither=neither)
        self.model = model
        # Decided here: a trainer later puts its DDP or DeepSpeed wrapper in `self.model`, never in `self.guide`.
        self.guides_itself = guide is model
        if self.guides_itself and guide_embeddings is not None:
            raise ValueError(
                "guide=model guides the loss by the model's own embeddings of each step, which a precomputed "
                "guide_embeddings table would replace with frozen ones: pass one or the other."
            )
        if offload_guide and guide is not None:  # None with offload_guide was refused above
            self._check_can_let_go(guide)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}.")
        if margin_strategy not in ("absolute", "relative"):
            raise ValueError(f"margin_strategy must be 'absolute' or 'relative', got {margin_strategy!r}.")
        if gather_across_devices and all_gather_with_grad() is None:
            raise ValueError("gather_across_devices needs sentence-transformers' all_gather_with_grad (5.x or newer).")
        self._hold_encoder(guide, offloaded=offload_guide)
        # A model guiding itself reads no tokens of its own: it needs no tokenizer, and any model can.
        self.retokenize_with = None if guide is None or self.guides_itself else retokenizer_for(model, guide)
        if self.retokenize_with is not None and embeds_with_static_embedding(model):
            # Upstream's check and error: a StaticEmbedding model's features cannot be decoded to re-tokenize.
            raise ValueError(
                "If we must retokenize because the guide model has a different tokenizer, "
                "then the Sentence Transformer model must not be based on a StaticEmbedding."
            )
        self.guide_embeddings = guide_embeddings
        self.temperature = temperature
        self.margin_strategy = margin_strategy
        self.margin = margin
        self.contrast_anchors = contrast_anchors
        self.contrast_positives = contrast_positives
        self.gather_across_devices = gather_across_devices

    def _gist_options(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "margin_strategy": self.margin_strategy,
            "margin": self.margin,
            "contrast_anchors": self.contrast_anchors,
            "contrast_positives": self.contrast_positives,
            "gather_across_devices": self.gather_across_devices,
        }

    def frozen_embeddings(self, sentence_features: list[Features], ranges: list[Ranges]) -> Reps | None:
        """The guide's embeddings: from the table when it holds every row, else from the live guide; None when
        the model guides itself (:func:`gist_loss` takes its embeddings, detached)."""
        if self.guides_itself:
            return None
        looked_up = self._rows_from_table(sentence_features)
        if looked_up is not None:
            return [[embeddings] for embeddings in looked_up]
        guide = self.guide
        assert guide is not None, "_rows_from_table raises when neither the table nor a guide has the rows"
        return guide_pass(
            guide,
            sentence_features,
            ranges,
            self.retokenize_with,
            offloaded=self.offload_guide,
            show_progress_bar=self.show_progress_bar,
        )

    def _check_can_let_go(self, encoder: nn.Module) -> None:
        if self.guides_itself:
            raise ValueError(
                "This GIST loss is guided by the model itself (guide=model): there is no separate guide to offload, "
                "precompute or release."
            )
        if shares_parameters(self.model, encoder):
            raise ValueError(
                "Offloading or releasing this guide would freeze and move the model being trained: the guide "
                "shares its parameters. Use a separate guide model."
            )

    def _table_for(self, encoder: nn.Module, datasets: Any, **kwargs: Any) -> GuideEmbeddings:
        return GuideEmbeddings.from_dataset(self.model, encoder, datasets, **kwargs)

    def get_config_dict(self) -> dict[str, Any]:
        """Upstream's parameters in upstream's order; ``guide_embeddings``, ``offload_guide`` (and
        options newer than the installed upstream) only when set to something else than their default."""
        return card_config(self, getattr(_upstream, type(self).__name__))


@named_like_upstream(_upstream.CachedGISTEmbedLoss)
class CachedGISTEmbedLoss(GuidedLoss):
    """GISTEmbed with GradCache: batch-sized, guide-filtered in-batch negatives in mini-batch memory.

    For every anchor, the other rows' positives, anchors and negatives are negatives, except those
    that the frozen guide model rates as more similar to the anchor than the anchor's own positive
    (minus a margin): those are likely false negatives and are masked out. The batch is embedded
    in mini-batches (GradCache), so memory follows ``mini_batch_size``, not the batch size, with
    the gradients of the full batch.

    Takes upstream's arguments in the installed release's order (and every option of 6.x's on
    older releases, keyword-only), plus two ways to keep the guide off the accelerator.

    Args:
        model: the SentenceTransformer being trained.
        guide: the frozen SentenceTransformer that rates the negatives. May be None with
            ``guide_embeddings``. ``model`` itself: the model guides itself with its own embeddings
            of the step, detached, without a second forward pass (under Matryoshka the truncated
            ones, under a layer-wise loss each layer's own); an absolute ``margin`` below 0 then
            keeps candidates scored up to ``-margin`` above the positive (Qwen3-Embedding: ``-0.1``).
        temperature: the softmax temperature of the cross-entropy (upstream's default 0.01).
        mini_batch_size: rows embedded per forward pass; sets memory, not the result. ``"auto"``:
            the largest that fits ``memory_budget_mb`` (see :mod:`st_ext.losses.auto_mini_batch`).
        mini_batch_num_tokens: alternatively, a budget of non-padding tokens per mini-batch.
        show_progress_bar: show the mini-batch progress.
        margin_strategy: ``"absolute"`` (mask above ``positive - margin``) or ``"relative"``
            (mask above ``positive - |positive| * margin``; 4.x's upstream used
            ``positive * (1 - margin)``, which inverts for negative similarities).
        margin: the margin of ``margin_strategy``.
        contrast_anchors: also use the other anchors as negatives.
        contrast_positives: also contrast each positive with the other positives.
        gather_across_devices: under DDP, use every rank's candidates as negatives (5.x or newer).
        guide_embeddings: keyword-only; a :class:`GuideEmbeddings` table computed before training.
            With ``guide=None`` no guide is held during training; with a guide too, rows missing
            from the table (e.g. evaluation) use the live guide.
        offload_guide: keyword-only; keep the guide on the CPU and move it onto the training
            device only for its no-grad pass in each step.
        memory_budget_mb: keyword-only, with ``mini_batch_size="auto"``: the step's peak memory
            above its starting level, in MiB. None: a share of the free memory on CUDA; on the CPU,
            the whole batch as one mini-batch. The auto mode also keeps as many mini-batch graphs as
            the budget holds beside its backward.
        kept_graphs: keyword-only, with a numeric ``mini_batch_size``: how many mini-batches (the
            first ones) keep their graph for the backward instead of being embedded a second time:
            faster, with that many graphs in memory. None or 0: every mini-batch is embedded again.
        document_ids: keyword-only; ``"label"`` or a function of the batch giving each row's document id, or
            ``"text"`` (rows with an identical text are one document): candidates from a row's own document
            (gathered ones too) are masked as negatives (:mod:`st_ext.losses.same_document`).

    References:
        - GISTEmbed: https://huggingface.co/papers/2402.16829
        - GradCache: https://huggingface.co/papers/2101.06983

    Inputs:
        +-------------------------------------------------+--------+
        | Texts                                           | Labels |
        +=================================================+========+
        | (anchor, positive) pairs                        | none   |
        +-------------------------------------------------+--------+
        | (anchor, positive, negative) triplets           | none   |
        +-------------------------------------------------+--------+
        | (anchor, positive, negative_1, ..., negative_n) | none   |
        +-------------------------------------------------+--------+

    Example:
        ::

            from datasets import Dataset
            from st_ext import SentenceTransformer, SentenceTransformerTrainer, losses, offload

            model = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
            guide = SentenceTransformer("sentence-transformers/all-mpnet-base-v2")
            train_dataset = Dataset.from_dict({
                "anchor": ["It's nice weather outside today.", "He drove to work."],
                "positive": ["It's so sunny.", "He took the car to the office."],
            })
            loss = losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=32, offload_guide=True)
            # or: embed once with the guide, free it, and train without it
            table = losses.GuideEmbeddings.from_dataset(model, guide, train_dataset)
            offload.release(guide)
            loss = losses.CachedGISTEmbedLoss(model, None, guide_embeddings=table)
            # or: no guide at all, the model guides itself
            loss = losses.CachedGISTEmbedLoss(model, model, mini_batch_size=32, margin=-0.1)
            SentenceTransformerTrainer(model=model, train_dataset=train_dataset, loss=loss).train()
    """

    uses_gradient_cache = True

    @follows_upstream_signature(_upstream.CachedGISTEmbedLoss)
    def __init__(
        self,
        model: nn.Module,
        guide: nn.Module | None = None,
        temperature: float = 0.01,
        mini_batch_size: int | Literal["auto"] = 32,
        mini_batch_num_tokens: int | None = None,
        show_progress_bar: bool = False,
        margin_strategy: Literal["absolute", "relative"] = "absolute",
        margin: float = 0.0,
        contrast_anchors: bool = True,
        contrast_positives: bool = True,
        gather_across_devices: bool = False,
        *,
        guide_embeddings: GuideEmbeddings | None = None,
        offload_guide: bool = False,
        memory_budget_mb: float | None = None,
        kept_graphs: int | None = None,
        document_ids: DocumentIds | None = None,
    ) -> None:
        super().__init__()
        if embeds_with_static_embedding(model):
            raise ValueError(
                "CachedGISTEmbedLoss is not compatible with a SentenceTransformer model based on a StaticEmbedding "
                "(also behind a Router): its inputs have no batch dimension to split into mini-batches. "
                "Consider using GISTEmbedLoss instead."
            )
        self.auto_mini_batch = make_auto_mini_batch(
            mini_batch_size, mini_batch_num_tokens, memory_budget_mb, kept_graphs
        )
        self.memory_budget_mb = memory_budget_mb
        self.kept_graphs = kept_graphs
        self._set_up(
            model,
            guide,
            temperature=temperature,
            margin_strategy=margin_strategy,
            margin=margin,
            contrast_anchors=contrast_anchors,
            contrast_positives=contrast_positives,
            gather_across_devices=gather_across_devices,
            guide_embeddings=guide_embeddings,
            offload_guide=offload_guide,
        )
        self.mini_batch_size = mini_batch_size
        self.mini_batch_num_tokens = mini_batch_num_tokens
        self.show_progress_bar = show_progress_bar
        check_document_ids(document_ids, type(self).__name__)
        self.document_ids = document_ids
        upstream_hook_overrides(self, _upstream.CachedGISTEmbedLoss)

    def forward(self, sentence_features: Iterable[Features], labels: Tensor | None = None) -> Tensor:
        loss = gradcache_forward(self.cached_loss(), sentence_features, labels)
        assert isinstance(loss, Tensor), "a described loss has no terms: the engine returns its one value"
        return loss

    def cached_loss(self) -> CachedLoss:
        """This loss for the engine: the guide's embeddings are the frozen ones, and the loss over
        embeddings scores the anchors a mini-batch at a time."""

        def start(sentence_features: list[Features], ranges: list[Ranges], mini_batch_size: int) -> LossStep:
            guide_reps = self.frozen_embeddings(sentence_features, ranges)
            document_ids = StepDocumentIds(self.document_ids, sentence_features)

            def loss_fn(reps: Reps, labels: Tensor | None, *, with_backward: bool) -> Tensor:
                return gist_loss(
                    reps,
                    guide_reps,
                    **self._gist_options(),
                    chunk_size=mini_batch_size,
                    with_backward=with_backward,
                    show_progress_bar=self.show_progress_bar,
                    document_ids=document_ids(labels),
                )

            return LossStep(lambda source: loss_fn)

        return described(self, start)


@named_like_upstream(_upstream.GISTEmbedLoss)
class GISTEmbedLoss(GuidedLoss):
    """GISTEmbed: in-batch negatives filtered by a frozen guide model, whose guide can be offloaded,
    replaced by a precomputed table, or be the model itself.

    As :class:`CachedGISTEmbedLoss`, with the whole batch in one forward pass. Takes upstream's
    arguments in the installed release's order (and 6.x's options on older releases, keyword-only),
    any number of negative columns, and 6.x's relative margin on every release.

    Args:
        model: the SentenceTransformer being trained.
        guide: the frozen SentenceTransformer that rates the negatives. May be None with
            ``guide_embeddings``, or ``model`` itself (see :class:`CachedGISTEmbedLoss`).
        temperature: the softmax temperature of the cross-entropy (upstream's default 0.01).
        margin_strategy: ``"absolute"`` or ``"relative"``, see :class:`CachedGISTEmbedLoss`.
        margin: the margin of ``margin_strategy``.
        contrast_anchors: also use the other anchors as negatives.
        contrast_positives: also contrast each positive with the other positives.
        gather_across_devices: under DDP, use every rank's candidates as negatives (5.x or newer).
        guide_embeddings: keyword-only; a :class:`GuideEmbeddings` table computed before training.
        offload_guide: keyword-only; keep the guide on the CPU between its no-grad passes.
        document_ids: keyword-only; ``"label"`` or a function of the batch giving each row's document id, or
            ``"text"`` (rows with an identical text are one document): candidates from a row's own document are
            masked (:mod:`st_ext.losses.same_document`).

    References:
        - GISTEmbed: https://huggingface.co/papers/2402.16829

    Inputs:
        +-------------------------------------------------+--------+
        | Texts                                           | Labels |
        +=================================================+========+
        | (anchor, positive) pairs                        | none   |
        +-------------------------------------------------+--------+
        | (anchor, positive, negative) triplets           | none   |
        +-------------------------------------------------+--------+
        | (anchor, positive, negative_1, ..., negative_n) | none   |
        +-------------------------------------------------+--------+

    Example: as :class:`CachedGISTEmbedLoss`'s, without ``mini_batch_size``.
    """

    @follows_upstream_signature(_upstream.GISTEmbedLoss)
    def __init__(
        self,
        model: nn.Module,
        guide: nn.Module | None = None,
        temperature: float = 0.01,
        margin_strategy: Literal["absolute", "relative"] = "absolute",
        margin: float = 0.0,
        contrast_anchors: bool = True,
        contrast_positives: bool = True,
        gather_across_devices: bool = False,
        *,
        guide_embeddings: GuideEmbeddings | None = None,
        offload_guide: bool = False,
        document_ids: DocumentIds | None = None,
    ) -> None:
        super().__init__()
        self._set_up(
            model,
            guide,
            temperature=temperature,
            margin_strategy=margin_strategy,
            margin=margin,
            contrast_anchors=contrast_anchors,
            contrast_positives=contrast_positives,
            gather_across_devices=gather_across_devices,
            guide_embeddings=guide_embeddings,
            offload_guide=offload_guide,
        )
        self.show_progress_bar = False
        check_document_ids(document_ids, type(self).__name__)
        self.document_ids = document_ids

    def forward(self, sentence_features: Iterable[Features], labels: Tensor | None = None) -> Tensor:
        sentence_features = list(sentence_features)
        whole_batch = [[(0, batch_size_of(features))] for features in sentence_features]
        guide_reps = self.frozen_embeddings(sentence_features, whole_batch)
        with inputs_kept(sentence_features):
            reps = [[self.model(features)["sentence_embedding"]] for features in sentence_features]
        document_ids = StepDocumentIds(self.document_ids, sentence_features)(labels)
        return gist_loss(
            reps,
            guide_reps,
            **self._gist_options(),
            chunk_size=len(reps[0][0]),
            with_backward=False,
            document_ids=document_ids,
        )


def upstream_cached_gist(loss: Any) -> CachedLoss:
    """Upstream's ``CachedGISTEmbedLoss`` for the engine: its guide runs once per step, and its loss over
    embeddings is the class's ``calculate_loss`` (not an instance's that upstream's Matryoshka decorated)."""

    def start(sentence_features: list[Features], ranges: list[Ranges], mini_batch_size: int) -> LossStep:
        retokenize_with = loss.tokenizer if loss.must_retokenize else None
        show_progress_bar = getattr(loss, "show_progress_bar", False)
        guide_reps = guide_pass(
            loss.guide, sentence_features, ranges, retokenize_with, show_progress_bar=show_progress_bar
        )

        def loss_fn(reps: Reps, labels: Tensor | None, *, with_backward: bool) -> Tensor:
            return type(loss).calculate_loss(loss, reps, guide_reps, with_backward=with_backward)

        return LossStep(lambda source: loss_fn)

    return described(loss, start)
