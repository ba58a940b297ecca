"""A model that really consumes flattened (unpadded) inputs, on the CPU.

sentence-transformers 5.4+ flattens a batch (``cu_seq_lens_q``, ``position_ids``, no padding) when the
model's attention takes variable-length sequences, which in practice means flash-attention 2 on a
GPU. Here a plain-torch variable-length attention is registered in transformers' attention-function
registry: it attends within each sequence of the flattened batch, so its outputs are wrong unless the
sequence boundaries are right. Upstream decides to flatten from the implementation's name ("flash")
and from a flash-attention package; :func:`make_flattening` answers those two probes for this
implementation and lets upstream's own ``unpad_inputs`` setter configure the module.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.nn.functional as F

VARLEN_ATTENTION = "varlen_sdpa"


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention within each sequence of a flattened batch: ``query`` is ``(1, heads, tokens, head_dim)``."""
    bounds = kwargs["cu_seq_lens_q"].tolist()
    output = torch.empty_like(query)
    for begin, end in zip(bounds[:-1], bounds[1:]):
        output[:, :, begin:end] = F.scaled_dot_product_attention(
            query[:, :, begin:end], key[:, :, begin:end], value[:, :, begin:end], dropout_p=dropout, scale=scaling
        )
    return output.transpose(1, 2).contiguous(), None


def flattening_supported() -> bool:
    """Whether the installed sentence-transformers flattens inputs for this plain-torch kernel: from 6.0 on,
    its Transformer asks itself (``_is_flash_attention_requested``), which :func:`make_flattening` answers;
    5.4-5.7 flatten only for an attention transformers itself counts as flash-attention."""
    from st_ext._compat import st_modules

    transformer = st_modules().Transformer
    return hasattr(transformer, "unpad_inputs") and hasattr(transformer, "_is_flash_attention_requested")


def make_flattening(model):
    """Switch ``model``'s Transformer to the variable-length attention and to flattened inputs."""
    import transformers.modeling_flash_attention_utils as flash_utils
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)
    transformer = model[0]
    transformer.auto_model.set_attn_implementation(VARLEN_ATTENTION)
    transformer._is_flash_attention_requested = lambda: True
    functions = ((None, varlen_attention, None, None, None), (dict, dict))
    with mock.patch.object(flash_utils, "lazy_import_flash_attention", return_value=functions):
        transformer.unpad_inputs = True
    assert transformer.can_flatten_inputs, "upstream declined to flatten this model's inputs"
    return model
