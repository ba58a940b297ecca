"""The pooled embedding of several transformer layers from one forward pass: an encoder for GradCache.

As upstream's ``AdaptiveLayerLoss`` does, an earlier layer's hidden states go through the modules
after the transformer (pooling, normalisation, dense layers) in place of the last layer's. Those
modules run on each layer directly, outside any DDP wrapper, so the wrapper still sees one forward
pass per backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

from torch import Tensor, nn

from st_ext._compat import unwrapped_model
from st_ext.losses.features import Features, collator_inputs

if TYPE_CHECKING:  # upstream's Transformer module as 6.x places it
    from sentence_transformers.base.modules.transformer import Transformer


@contextmanager
def hidden_states_on(transformer: Transformer) -> Iterator[None]:
    config = transformer.auto_model.config
    before = config.output_hidden_states
    config.output_hidden_states = True
    try:
        yield
    finally:
        config.output_hidden_states = before


class LayerEmbeddings:
    """:data:`~st_ext.losses.loss_functions.Encoder` giving ``[sentence embedding, embedding from layer a, …]``.

    The hidden-state indices are chosen on the first call by ``choose(num_hidden_states)`` (layers + 1);
    every later call (the other mini-batches, step (3)'s replay) embeds the same ones.
    """

    def __init__(self, choose: Callable[[int], Sequence[int]]) -> None:
        self.choose = choose
        self.layers: list[int] | None = None
        self.num_hidden_states: int | None = None

    def __call__(self, model: nn.Module, features: Features) -> list[Tensor]:
        base = cast(nn.Sequential, unwrapped_model(model))  # a SentenceTransformer: its modules in order
        transformer, tail = cast("Transformer", base[0]), list(base)[1:]
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
        if self.layers is None:
            self.num_hidden_states = len(hidden_states)
            self.layers = list(self.choose(len(hidden_states)))
        elif len(hidden_states) != self.num_hidden_states:
            raise RuntimeError(
                f"The model returned {len(hidden_states)} hidden states after {self.num_hidden_states} earlier in "
                "the same step; a layer-wise loss needs the same layers in every forward pass."
            )
        outputs = [final]
        for layer in self.layers:
            copies = {key: value.clone() for key, value in inputs.items()}
            layer_features = {**captured, **copies, "token_embeddings": hidden_states[layer]}
            for module in tail:
                layer_features = module(layer_features)
            outputs.append(layer_features["sentence_embedding"])
        return outputs
