"""Cached losses seen through the :class:`~st_ext.losses.gradcache.CachedLoss` protocol: one registry.

A wrapper that runs GradCache itself around a cached loss (:class:`~st_ext.losses.MatryoshkaLoss`,
:class:`~st_ext.losses.CrossBatchMemoryLoss`) asks :func:`cached_loss_view` for the loss as a
``CachedLoss``: its model and mini-batch settings, its frozen embeddings, and its loss over
embeddings. The answer comes from the adapter registered for the loss's class, or for the nearest
base class that has one (along the MRO); None means no adapter applies and the wrapper treats the
loss as it would any other.

Supporting another cached loss means registering it, not editing a wrapper::

    register_cached_loss(MyCachedLoss, MyCachedLossAdapter)

An adapter is called with the loss instance and returns a ``CachedLoss`` or None (the loss does not
cache after all); it may raise to refuse a loss no wrapper can run. The adapters here only read the
upstream losses they wrap: nothing is set on them.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from torch import Tensor, nn

from st_ext._compat import upstream_cached_loss_mixin, upstream_loss_class
from st_ext.losses.gist import CachedGISTEmbedLoss, guide_pass
from st_ext.losses.gradcache import CachedLoss, Features, Ranges, Reps
from st_ext.losses.overrides import upstream_hook_overrides

#: Turns a loss instance into its :class:`CachedLoss` view, or None.
CachedLossAdapter = Callable[[nn.Module], "CachedLoss | None"]

_ADAPTERS: dict[type, CachedLossAdapter] = {}


def register_cached_loss(loss_class: type, adapter: CachedLossAdapter) -> None:
    """Make :func:`cached_loss_view` answer ``adapter(loss)`` for instances of ``loss_class`` and of its
    subclasses (unless a subclass registers its own). Registering a class again replaces its adapter."""
    _ADAPTERS[loss_class] = adapter


def cached_loss_view(loss: nn.Module) -> CachedLoss | None:
    """``loss`` as a :class:`CachedLoss` when st_ext runs its GradCache itself, else None.

    The adapter of the first class along ``type(loss).__mro__`` that has one decides. None means the
    wrapper handles ``loss`` as upstream would without st_ext (including a gradient-caching loss st_ext
    cannot reach into: upstream then raises or runs it as the installed release does, and a subclass
    that overrides a step of upstream's engine, which only upstream's engine calls).
    """
    for cls in type(loss).__mro__:
        adapter = _ADAPTERS.get(cls)
        if adapter is not None:
            return None if upstream_hook_overrides(loss, cls) else adapter(loss)
    return None


# ---------------------------------------------------------------------------------------------
# Upstream's cached losses (read-only: nothing is set on them)


class UpstreamCachedLoss:
    """An upstream cached ranking loss as a :class:`CachedLoss`: ``CachedMultipleNegatives(Symmetric)RankingLoss``,
    and on releases with a shared GradCache base, every loss built on it (e.g. ``MegaBatchMarginLoss``).

    Calls the class's ``calculate_loss``, not the instance's, so an instance that upstream's
    ``MatryoshkaLoss`` already decorated is not truncated a second time; with ``as_decorated``,
    the instance's (the loss runs itself, and upstream's wrapper may have decorated it).
    """

    def __init__(self, loss: nn.Module, *, as_decorated: bool = False) -> None:
        self.loss = loss
        self.as_decorated = as_decorated

    @property
    def model(self) -> nn.Module:
        return self.loss.model

    @property
    def settings_holder(self) -> nn.Module:
        """The loss whose ``mini_batch_size`` (and ``auto_mini_batch``) this view reads."""
        return self.loss

    @property
    def mini_batch_size(self) -> int:
        return self.loss.mini_batch_size

    @property
    def mini_batch_num_tokens(self) -> int | None:
        return getattr(self.loss, "mini_batch_num_tokens", None)

    @property
    def show_progress_bar(self) -> bool:
        return getattr(self.loss, "show_progress_bar", False)

    def frozen_embeddings(self, sentence_features: list[Features], ranges: list[Ranges]) -> Reps | None:
        return None

    def loss_from_embeddings(
        self, reps: Reps, frozen: Reps | None, labels: Tensor | None, *, with_backward: bool
    ) -> Tensor:
        calculate_loss = partial(type(self.loss).calculate_loss, self.loss)
        if self.as_decorated:
            calculate_loss = self.loss.calculate_loss
        mixin = upstream_cached_loss_mixin()
        if mixin is not None and isinstance(self.loss, mixin):
            # 5.7+'s shared base: every such loss takes the labels (MegaBatchMarginLoss ignores them).
            return calculate_loss(reps, labels, with_backward=with_backward)
        return calculate_loss(reps, with_backward=with_backward)


class UpstreamCachedGIST(UpstreamCachedLoss):
    """An upstream ``CachedGISTEmbedLoss`` as a :class:`CachedLoss`: its guide runs once, in GradCache's step (1)."""

    def frozen_embeddings(self, sentence_features: list[Features], ranges: list[Ranges]) -> Reps:
        retokenize_with = self.loss.tokenizer if self.loss.must_retokenize else None
        return guide_pass(
            self.loss.guide, sentence_features, ranges, retokenize_with, show_progress_bar=self.show_progress_bar
        )

    def loss_from_embeddings(
        self, reps: Reps, frozen: Reps | None, labels: Tensor | None, *, with_backward: bool
    ) -> Tensor:
        return type(self.loss).calculate_loss(self.loss, reps, frozen, with_backward=with_backward)


def _if_gradient_caching(loss: nn.Module) -> UpstreamCachedLoss | None:
    """A loss on upstream's shared GradCache base that marks itself as caching (5.7+)."""
    return UpstreamCachedLoss(loss) if getattr(loss, "uses_gradient_cache", False) else None


def _register_builtin_adapters() -> None:
    register_cached_loss(CachedGISTEmbedLoss, lambda loss: loss)  # st_ext's own: already a CachedLoss
    mixin = upstream_cached_loss_mixin()
    if mixin is not None:
        register_cached_loss(mixin, _if_gradient_caching)
    for name in ("CachedMultipleNegativesRankingLoss", "CachedMultipleNegativesSymmetricRankingLoss"):
        upstream_class = upstream_loss_class(name)
        if upstream_class is not None:
            register_cached_loss(upstream_class, UpstreamCachedLoss)
    register_cached_loss(upstream_loss_class("CachedGISTEmbedLoss"), UpstreamCachedGIST)


_register_builtin_adapters()
