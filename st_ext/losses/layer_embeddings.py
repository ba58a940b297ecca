"""The pooled embedding of several transformer layers from one forward pass: an encoder for GradCache.

A layer-wise loss (:mod:`st_ext.losses.adaptive_layer`) trains the model's output as if it stopped
after an earlier layer: that layer's hidden states go through the modules after the transformer
(pooling, normalisation, dense layers) instead of the last layer's, as upstream's
``AdaptiveLayerLoss`` does. :class:`LayerEmbeddings` gives, for one mini-batch and one forward pass,
the sentence embedding followed by that embedding computed from each chosen layer, so GradCache can
cache them all in step (1) and back-propagate all of their gradients through one graph in step (3).

The hidden states come from the transformer with ``output_hidden_states`` switched on for the pass
(and back to the model's setting after it); the modules after the transformer run on each layer
directly, outside any DDP wrapper, so the wrapper still sees one forward pass per backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from torch import Tensor, nn

from st_ext._compat import unwrapped_model
from st_ext.losses.features import Features, collator_inputs

#: Chooses the hidden-state indices to embed, given how many hidden states the model has (layers + 1).
ChooseLayers = Callable[[int], Sequence[int]]


@contextmanager
def hidden_states_on(transformer: nn.Module) -> Iterator[None]:
    """The transformer also returns every layer's hidden states (``all_layer_embeddings``) in the block."""
    config = transformer.auto_model.config
    before = config.output_hidden_states
    config.output_hidden_states = True
    try:
        yield
    finally:
        config.output_hidden_states = before


class LayerEmbeddings:
    """:data:`~st_ext.losses.gradcache.Encoder` giving ``[sentence embedding, embedding from layer a, …]``.

    The layers are chosen on the first call, when the number of hidden states is known, by
    ``choose(num_hidden_states)``; every later call (the other mini-batches, step (3)'s replay) embeds
    the same ones.
    """

    def __init__(self, choose: ChooseLayers) -> None:
        self.choose = choose
        self.layers: list[int] | None = None
        self.num_hidden_states: int | None = None

    def __call__(self, model: nn.Module, features: Features) -> list[Tensor]:
        base = unwrapped_model(model)
        transformer, tail = base[0], list(base)[1:]
        captured: dict = {}
        # What the collator made, before a module edits it in place (5.x's prompt exclusion is not idempotent).
        inputs = {key: value.clone() for key, value in collator_inputs(features).items()}
        handle = transformer.register_forward_hook(lambda module, args, output: captured.update(output))
        try:
            with hidden_states_on(transformer):
                final = model(features)["sentence_embedding"]
        finally:
            handle.remove()
        hidden_states = captured.pop("all_layer_embeddings", None)
        if hidden_states is None:
            raise RuntimeError(
                f"{type(transformer.auto_model).__name__} returned no hidden states with output_hidden_states=True; "
                "a layer-wise loss needs them."
            )
        self._check_layers(len(hidden_states))
        outputs = [final]
        for layer in self.layers:
            copies = {key: value.clone() for key, value in inputs.items()}
            layer_features = {**captured, **copies, "token_embeddings": hidden_states[layer]}
            for module in tail:
                layer_features = module(layer_features)
            outputs.append(layer_features["sentence_embedding"])
        return outputs

    def _check_layers(self, num_hidden_states: int) -> None:
        if self.layers is None:
            self.num_hidden_states = num_hidden_states
            self.layers = list(self.choose(num_hidden_states))
        elif num_hidden_states != self.num_hidden_states:
            raise RuntimeError(
                f"The model returned {num_hidden_states} hidden states after {self.num_hidden_states} earlier in "
                "the same step; a layer-wise loss needs the same layers in every forward pass."
            )
