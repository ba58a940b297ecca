"""Upstream's cached ranking losses on st_ext's GradCache engine, with ``mini_batch_size="auto"``.

The classes subclass upstream's: its constructor (the installed release's arguments, in its order,
plus the keyword-only ``memory_budget_mb``, ``kept_graphs`` and, for CachedMultipleNegativesRankingLoss,
``document_ids``), its ``calculate_loss`` (every option of the installed release) and its model card; only the
forward pass is st_ext's. With ``document_ids`` the loss over embeddings is
:func:`~st_ext.losses.masked_ranking.masked_ranking_loss` instead, which masks candidates from an anchor's own
document (:mod:`st_ext.losses.same_document`). A subclass that overrides a step of
upstream's engine runs upstream's forward instead (:mod:`st_ext.losses.overrides`).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from torch import Tensor, nn

from st_ext._compat import st_losses, upstream_cached_loss_mixin
from st_ext.losses._signatures import follows_upstream_signature, named_like_upstream
from st_ext.losses.auto_mini_batch import AUTO, make_auto_mini_batch
from st_ext.losses.gradcache import CachedLoss, Features, LossStep, described, gradcache_forward
from st_ext.losses.loss_functions import Reps
from st_ext.losses.masked_ranking import (
    CandidateIds,
    check_scoring_options,
    masked_ranking_loss,
    refuse_scoring_overrides,
)
from st_ext.losses.overrides import upstream_hook_overrides
from st_ext.losses.same_document import DocumentIds, StepDocumentIds, check_document_ids

if TYPE_CHECKING:  # upstream's losses as 6.x places them; at run time, the installed release's
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import losses as _upstream
else:
    _upstream = st_losses()
#: 5.7+'s shared GradCache base (None before): every loss on it takes the labels in ``calculate_loss``.
_CACHED_LOSS_MIXIN = upstream_cached_loss_mixin()

#: Stands in for ``"auto"`` while upstream's constructor runs (it may check that the size is a number).
_PLACEHOLDER_SIZE = 32


class CachedRankingMixin(nn.Module):
    """What both classes add to their upstream base (``st_ext_upstream_class``): the auto mode and
    st_ext's forward pass."""

    st_ext_upstream_class: ClassVar[type[nn.Module]]
    #: Upstream's attribute, an int there; ``"auto"`` here until each batch resolves it.
    mini_batch_size: int | Literal["auto"]
    document_ids: DocumentIds | None

    def _set_up(
        self,
        memory_budget_mb: float | None,
        kept_graphs: int | None,
        upstream_arguments: dict[str, Any],
        document_ids: DocumentIds | None = None,
    ) -> None:
        """Upstream's constructor (and its deprecation warning, where it has one), then the auto mode and the
        same-document masking."""
        upstream_class = self.st_ext_upstream_class
        deprecation = getattr(upstream_class, "__deprecated__", None)
        if deprecation:
            # The user's call: this frame, the class's __init__ and its argument binder are st_ext's.
            warnings.warn(deprecation, DeprecationWarning, stacklevel=4)
        auto = upstream_arguments["mini_batch_size"] == AUTO
        if auto:
            upstream_arguments = {**upstream_arguments, "mini_batch_size": _PLACEHOLDER_SIZE}
        upstream_class.__init__(self, **upstream_arguments)
        if auto:
            self.mini_batch_size = AUTO
        self.auto_mini_batch = make_auto_mini_batch(
            self.mini_batch_size, getattr(self, "mini_batch_num_tokens", None), memory_budget_mb, kept_graphs
        )
        self.memory_budget_mb = memory_budget_mb
        self.kept_graphs = kept_graphs
        # Whether upstream's forward must run this loss: fixed by its class, so decided once, here.
        self._runs_upstream_forward = bool(upstream_hook_overrides(self, upstream_class))
        name = type(self).__name__
        check_document_ids(document_ids, name)
        if document_ids is not None:
            check_scoring_options(self, f"{name} with document_ids")
            if self._runs_upstream_forward:
                raise TypeError(
                    f"{name} overrides a step of upstream's engine, which knows no document ids: drop document_ids "
                    "or the override."
                )
            refuse_scoring_overrides(self, f"{name} with document_ids")
        #: Where each row's document id comes from (:mod:`st_ext.losses.same_document`); None: no masking.
        self.document_ids = document_ids

    def forward(self, sentence_features: Iterable[Features], labels: Tensor | None = None) -> Tensor:
        sentence_features = list(sentence_features)
        if len(sentence_features) < 2:
            raise ValueError(f"Expected at least 2 inputs, got {len(sentence_features)}")
        if self._runs_upstream_forward:
            return super().forward(sentence_features, labels)
        if self.document_ids is not None:
            if "calculate_loss" in vars(self):
                raise TypeError(
                    f"{type(self).__name__} with document_ids scores its candidates itself, so upstream's "
                    "MatryoshkaLoss cannot truncate them: use st_ext.losses.MatryoshkaLoss."
                )
            loss = gradcache_forward(same_document_cached_loss(self), sentence_features, labels)
        else:
            loss = gradcache_forward(upstream_cached_loss(self, as_decorated=True), sentence_features, labels)
        assert isinstance(loss, Tensor), "a described loss has no terms: the engine returns its one value"
        return loss

    def cached_loss(self) -> CachedLoss | None:
        """This loss for the engine and the wrappers around it; None for a subclass that overrides a step of
        upstream's engine, which only upstream's forward calls."""
        if self._runs_upstream_forward:
            return None
        return upstream_cached_loss(self) if self.document_ids is None else same_document_cached_loss(self)


def upstream_cached_loss(loss: Any, *, as_decorated: bool = False) -> CachedLoss:
    """An upstream cached ranking loss described (on 5.7+, every loss on the shared GradCache base too,
    e.g. ``MegaBatchMarginLoss``).

    Its loss over embeddings is the class's ``calculate_loss``, not the instance's, so an instance that
    upstream's ``MatryoshkaLoss`` already decorated is not truncated a second time; with ``as_decorated``,
    the instance's (the loss runs itself, and upstream's wrapper may have decorated it). It scores every
    document column it is given: a column a wrapper adds (a cross-batch memory's queue) is more candidates.
    """
    # MegaBatchMarginLoss takes the labels too, and ignores them.
    takes_labels = _CACHED_LOSS_MIXIN is not None and isinstance(loss, _CACHED_LOSS_MIXIN)

    def start(sentence_features: list[Features], ranges, mini_batch_size: int) -> LossStep:
        sized = with_chunk_size(loss, mini_batch_size)
        calculate_loss = sized.calculate_loss if as_decorated else partial(type(loss).calculate_loss, sized)

        def loss_fn(reps: Reps, labels: Tensor | None, *, with_backward: bool) -> Tensor:
            return calculate_loss(*((reps, labels) if takes_labels else (reps,)), with_backward=with_backward)

        return LossStep(lambda source: loss_fn)

    return described(loss, start)


def same_document_cached_loss(loss: CachedRankingMixin) -> CachedLoss:
    """A cached ranking loss whose candidates from an anchor's own document (``loss.document_ids``, see
    :mod:`st_ext.losses.same_document`) are not its negatives: in every column, gathered ones too."""

    def start(sentence_features: list[Features], ranges, mini_batch_size: int) -> LossStep:
        document_ids = StepDocumentIds(loss.document_ids, sentence_features)

        def loss_fn(reps: Reps, labels: Tensor | None, *, with_backward: bool) -> Tensor:
            step_ids = document_ids(labels)
            assert step_ids is not None, "only a loss with document_ids masks its own documents"
            anchors, *columns = step_ids
            ids = CandidateIds(anchors, columns, anchors[:0], anchors[:0])
            nothing_queued = [[reps[0][0][:0].detach()]]
            return masked_ranking_loss(
                loss, reps + nothing_queued * 2, ids, chunk_size=mini_batch_size, with_backward=with_backward
            )

        return LossStep(lambda source: loss_fn)

    return described(loss, start)


class ScoresInChunks(Protocol):
    """What st_ext reads of an upstream cached loss: the size it scores its anchors by, and its loss over
    embeddings (which takes the labels too on upstream's shared GradCache base)."""

    mini_batch_size: int | Literal["auto"]

    def calculate_loss(self, *args: Any, **kwargs: Any) -> Tensor: ...


def with_chunk_size(loss: ScoresInChunks, mini_batch_size: int) -> ScoresInChunks:
    """``loss``, or for ``mini_batch_size="auto"`` a shallow copy of it holding this batch's resolved size:
    upstream's ``calculate_loss`` reads the size it scores its anchors by from its instance, and the user's
    loss keeps its ``"auto"`` (nothing is written on it)."""
    if loss.mini_batch_size != AUTO:
        return loss
    sized = copy.copy(loss)
    sized.mini_batch_size = mini_batch_size
    return sized


_NOTE = (
    'runs on st_ext\'s GradCache engine; ``mini_batch_size`` may be ``"auto"``, sized to the keyword-only '
    "``memory_budget_mb`` (MiB; see :mod:`st_ext.losses.auto_mini_batch`); the keyword-only ``kept_graphs`` "
    "keeps that many mini-batches' graphs for the backward instead of embedding them twice."
)


with warnings.catch_warnings():
    # A class upstream deprecates warns when subclassed too: at st_ext's import, not the user's use.
    # Constructing st_ext's class warns instead, as constructing upstream's does.
    warnings.simplefilter("ignore", DeprecationWarning)

    # mini_batch_size may be "auto" here (the auto mode), where upstream's attribute is an int.
    @named_like_upstream(_upstream.CachedMultipleNegativesRankingLoss, _NOTE)
    class CachedMultipleNegativesRankingLoss(  # type: ignore[misc]
        CachedRankingMixin, _upstream.CachedMultipleNegativesRankingLoss
    ):
        st_ext_upstream_class = _upstream.CachedMultipleNegativesRankingLoss

        if TYPE_CHECKING:  # what a type checker reads: 6.x's arguments, then st_ext's (tests/test_typing.py)

            def __init__(
                self,
                model: SentenceTransformer,
                scale: float = 20.0,
                similarity_fct: Callable[[Tensor, Tensor], Tensor] = ...,
                mini_batch_size: int | Literal["auto"] = 32,
                mini_batch_num_tokens: int | None = None,
                gather_across_devices: bool = False,
                directions: tuple[Literal["query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"], ...] = (
                    "query_to_doc",
                ),
                partition_mode: Literal["joint", "per_direction"] = "joint",
                show_progress_bar: bool = False,
                hardness_mode: Literal["in_batch_negatives", "hard_negatives", "all_negatives"] | None = None,
                hardness_strength: float = 0.0,
                *,
                memory_budget_mb: float | None = None,
                kept_graphs: int | None = None,
                document_ids: DocumentIds | None = None,
            ) -> None: ...

        else:

            @follows_upstream_signature(_upstream.CachedMultipleNegativesRankingLoss)
            def __init__(
                self,
                *,
                memory_budget_mb: float | None = None,
                kept_graphs: int | None = None,
                document_ids: DocumentIds | None = None,
                **upstream_arguments: Any,
            ) -> None:
                self._set_up(memory_budget_mb, kept_graphs, upstream_arguments, document_ids)

    # mini_batch_size may be "auto", as above.
    @named_like_upstream(_upstream.CachedMultipleNegativesSymmetricRankingLoss, _NOTE)
    class CachedMultipleNegativesSymmetricRankingLoss(  # type: ignore[misc]
        CachedRankingMixin, _upstream.CachedMultipleNegativesSymmetricRankingLoss
    ):
        st_ext_upstream_class = _upstream.CachedMultipleNegativesSymmetricRankingLoss

        if TYPE_CHECKING:  # what a type checker reads: 6.x's arguments, then st_ext's (tests/test_typing.py)

            def __init__(
                self,
                model: SentenceTransformer,
                scale: float = 20.0,
                similarity_fct: Callable[[Tensor, Tensor], Tensor] = ...,
                mini_batch_size: int | Literal["auto"] = 32,
                mini_batch_num_tokens: int | None = None,
                gather_across_devices: bool = False,
                show_progress_bar: bool = False,
                *,
                memory_budget_mb: float | None = None,
                kept_graphs: int | None = None,
            ) -> None: ...

        else:

            @follows_upstream_signature(_upstream.CachedMultipleNegativesSymmetricRankingLoss)
            def __init__(
                self,
                *,
                memory_budget_mb: float | None = None,
                kept_graphs: int | None = None,
                **upstream_arguments: Any,
            ) -> None:
                self._set_up(memory_budget_mb, kept_graphs, upstream_arguments)
