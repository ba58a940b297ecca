"""Which losses st_ext's GradCache engine can run, described (:class:`~st_ext.losses.gradcache.CachedLoss`).

st_ext's losses describe themselves: their ``cached_loss()`` method (None: not on st_ext's engine; an
error: no wrapper can run it). Upstream's cached losses are described here, in one function; a
subclass of one that overrides a step of upstream's engine gets None, since only upstream's engine
calls the override (:mod:`st_ext.losses.overrides`). A wrapper asks :func:`as_cached_loss` what it
wraps, and never names another wrapper.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from st_ext._compat import upstream_cached_loss_mixin, upstream_loss_class
from st_ext.losses.cached_ranking import upstream_cached_loss
from st_ext.losses.gist import upstream_cached_gist
from st_ext.losses.gradcache import CachedLoss
from st_ext.losses.overrides import upstream_hook_overrides

#: Upstream's cached ranking losses, described by their ``calculate_loss``; a subclass first (6.x's symmetric
#: loss subclasses the other), so that its overrides are judged against its own class.
_UPSTREAM_RANKING = ("CachedMultipleNegativesSymmetricRankingLoss", "CachedMultipleNegativesRankingLoss")


def as_cached_loss(loss: Any) -> CachedLoss | None:
    """``loss`` as a :class:`CachedLoss` when st_ext runs its GradCache, else None (a wrapper then treats
    it as upstream's wrapper would)."""
    describe_itself = getattr(loss, "cached_loss", None)
    if callable(describe_itself):
        return describe_itself()
    return upstream_description(loss)


def engine_description(loss: Any, wrapper: str) -> CachedLoss:
    """``loss`` described for a wrapper that runs it on st_ext's engine (it checked so when it was built)."""
    description = as_cached_loss(loss)
    if description is None:
        raise TypeError(f"{wrapper} runs {type(loss).__name__} on st_ext's GradCache engine, which cannot run it.")
    return description


def upstream_description(loss: Any) -> CachedLoss | None:
    """One of upstream's cached losses (GIST, the ranking losses, on 5.7+ every loss on the shared
    GradCache base that marks itself as caching) described; None for any other loss."""
    gist = upstream_loss_class("CachedGISTEmbedLoss")
    if gist is not None and isinstance(loss, gist):
        return None if upstream_hook_overrides(loss, gist) else upstream_cached_gist(loss)
    for name in _UPSTREAM_RANKING:
        ranking = upstream_loss_class(name)
        if ranking is not None and isinstance(loss, ranking):
            return None if upstream_hook_overrides(loss, ranking) else upstream_cached_loss(loss)
    mixin = upstream_cached_loss_mixin()
    if (
        mixin is not None
        and isinstance(loss, nn.Module)
        and isinstance(loss, mixin)
        and getattr(loss, "uses_gradient_cache", False)
    ):
        return None if upstream_hook_overrides(loss, mixin) else upstream_cached_loss(loss)
    return None
