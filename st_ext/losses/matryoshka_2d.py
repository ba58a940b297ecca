"""``Matryoshka2dLoss``: ``AdaptiveLayerLoss`` over ``MatryoshkaLoss``, as upstream defines it.

A composition of the two wrappers, kept apart from both so that neither imports the other. Over a cached
loss it runs GradCache over layers (:mod:`st_ext.losses.adaptive_layer`), each layer's dimensions drawn as
upstream draws them; over any other loss, upstream's implementation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from st_ext._compat import st_losses
from st_ext.losses._signatures import follows_upstream_signature, named_like_upstream
from st_ext.losses.adaptive_layer import LAYERWISE_NOTE, LayerwiseGradCache
from st_ext.losses.matryoshka import MatryoshkaLoss

if TYPE_CHECKING:  # upstream's losses as 6.x places them; at run time, the installed release's
    from sentence_transformers.sentence_transformer import losses as _upstream
else:
    _upstream = st_losses()

#: What ``Matryoshka2dLoss`` passes on to the ``MatryoshkaLoss`` it builds.
MATRYOSHKA_ARGUMENTS = ("matryoshka_dims", "matryoshka_weights", "n_dims_per_step")


@named_like_upstream(_upstream.Matryoshka2dLoss, LAYERWISE_NOTE)
class Matryoshka2dLoss(LayerwiseGradCache, _upstream.Matryoshka2dLoss):
    if not TYPE_CHECKING:  # a type checker reads upstream's constructor, which this one takes as it is

        @follows_upstream_signature(_upstream.Matryoshka2dLoss)
        def __init__(self, model: nn.Module, loss: nn.Module, **upstream_arguments: Any) -> None:
            dimensions = {name: upstream_arguments.pop(name) for name in MATRYOSHKA_ARGUMENTS}
            self._set_up(model, MatryoshkaLoss(model, loss, **dimensions), upstream_arguments)
