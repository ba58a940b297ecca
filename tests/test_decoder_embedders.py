"""Decoder embedders with LoRA adapters under st_ext's memory levers.

Tiny Qwen3 and Qwen2 decoders (last-token pooling, left padding, an instruction prompt on the queries) with
a LoRA adapter attached three ways: upstream's ``model.add_adapter(LoraConfig(...))`` where the installed
transformers accepts the installed peft, peft's ``get_peft_model`` on the Hugging Face model, and loaded
from a saved adapter folder. Each cached loss's gradients on the adapter weights equal the uncached
loss's; only the adapter trains; saving writes the adapter as peft does and reloading encodes identically.
"""

from __future__ import annotations

import json

import pytest
import torch
from loss_checks import assert_same_grads, features_of, loss_and_grads, text_columns
from tiny_decoders import (
    FAMILIES,
    LORA_TARGETS,
    QUERY_PROMPT,
    decoder_embedder,
    lora_config,
    save_tiny_decoder,
    with_query_prompt,
)

from st_ext import losses
from st_ext._compat import st_losses
from st_ext.memory import measure_peak

peft = pytest.importorskip("peft")

from st_ext.adapters import add_lora_adapter, load_lora_adapter, transformers_accepts_peft  # noqa: E402

upstream = st_losses()
BATCH = 8
DIMS = [32, 16, 8]
ATTACH = ["add_adapter", "get_peft_model", "saved_adapter"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def decoder_dirs(tmp_path_factory):
    return {family: tmp_path_factory.mktemp(f"tiny_{family}") for family in FAMILIES}


def decoder_path(decoder_dirs, family):
    path = decoder_dirs[family]
    if not (path / "config.json").exists():
        save_tiny_decoder(path, family)
    return path


@pytest.fixture(scope="module")
def saved_adapters(tmp_path_factory, decoder_dirs):
    """Per family, a sentence-transformers folder whose Transformer module is a saved LoRA adapter."""
    folders = {}

    def saved(family):
        if family not in folders:
            model = decoder_embedder(decoder_path(decoder_dirs, family))
            torch.manual_seed(5)
            add_lora_adapter(model, lora_config())
            folders[family] = tmp_path_factory.mktemp(f"adapter_{family}")
            model.save(str(folders[family]))
        return folders[family]

    return saved


def adapted(decoder_dirs, saved_adapters, family, attach="get_peft_model"):
    """A fresh tiny decoder embedder of ``family`` with a LoRA adapter attached the ``attach`` way."""
    model = decoder_embedder(decoder_path(decoder_dirs, family))
    torch.manual_seed(3)
    if attach == "add_adapter":
        if not transformers_accepts_peft():
            pytest.skip("the installed transformers' add_adapter refuses the installed peft")
        model.add_adapter(lora_config())
    elif attach == "get_peft_model":
        parent = model[0]
        for name, child in list(parent.named_children()):
            if child is parent.auto_model:
                setattr(parent, name, peft.get_peft_model(child, lora_config()))
    else:
        load_lora_adapter(model, saved_adapters(family))
    return model


def adapter_names(model) -> set[str]:
    return {name for name, param in model.named_parameters() if param.requires_grad}


def assert_adapter_grads_only(model, result):
    """The gradients are exactly those of the adapter's weights (2 layers x targets x A and B), none zero."""
    _, grads = result
    trainable = adapter_names(model)
    assert trainable and all("lora_" in name for name in trainable), trainable
    assert len(trainable) == 2 * len(LORA_TARGETS) * 2
    assert set(grads) == trainable
    assert all(grad.abs().sum() > 0 for grad in grads.values())


def decoder_columns(num_columns=2, seed=0):
    return with_query_prompt(text_columns(BATCH, num_columns, seed=seed))


# ---------------------------------------------------------------------------------------------
# The tiny decoder embedders themselves


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_decoder_pads_left_and_pools_the_last_token(decoder_dirs, family):
    """A text's embedding does not depend on the batch it is padded in, and the query prompt changes it."""
    model = decoder_embedder(decoder_path(decoder_dirs, family))
    assert model.tokenizer.padding_side == "left"
    short, long = "a cat", "the dog is in the house by the river"
    alone = model.encode([short], convert_to_tensor=True)
    padded = model.encode([short, long], convert_to_tensor=True)
    torch.testing.assert_close(padded[0], alone[0], rtol=1e-4, atol=1e-5)
    prompted = model.encode([short], prompt_name="query", convert_to_tensor=True)
    assert not torch.allclose(prompted, alone)
    torch.testing.assert_close(prompted, model.encode([QUERY_PROMPT + short], convert_to_tensor=True))


# ---------------------------------------------------------------------------------------------
# Cached losses: the adapter's gradients equal the uncached loss's


@pytest.mark.parametrize("attach", ATTACH)
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_mnrl_adapter_grads_equal_uncached(decoder_dirs, saved_adapters, family, attach):
    model = adapted(decoder_dirs, saved_adapters, family, attach)
    columns = decoder_columns(3)
    cached = loss_and_grads(
        model, losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3), columns, train=True
    )
    reference = loss_and_grads(model, upstream.MultipleNegativesRankingLoss(model), columns, train=True)
    assert_adapter_grads_only(model, reference)
    assert_same_grads(cached, reference)


@pytest.mark.parametrize("attach", ATTACH)
def test_cached_matryoshka_adapter_grads_equal_uncached(decoder_dirs, saved_adapters, attach):
    model = adapted(decoder_dirs, saved_adapters, "qwen3", attach)
    columns = decoder_columns()
    inner = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3)
    cached = loss_and_grads(model, losses.MatryoshkaLoss(model, inner, DIMS), columns, train=True)
    reference_loss = upstream.MatryoshkaLoss(model, upstream.MultipleNegativesRankingLoss(model), DIMS)
    reference = loss_and_grads(model, reference_loss, columns, train=True)
    assert_adapter_grads_only(model, reference)
    assert_same_grads(cached, reference)


@pytest.mark.parametrize("guide_kind", ["separate-guide", "guide-is-model"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_gist_adapter_grads_equal_uncached(decoder_dirs, saved_adapters, family, guide_kind):
    model = adapted(decoder_dirs, saved_adapters, family)
    if guide_kind == "separate-guide":
        guide = decoder_embedder(save_tiny_decoder(decoder_dirs[family].parent / f"guide_{family}", family, seed=1))
        guide.eval()
    else:
        guide = model
    columns = decoder_columns(3)
    cached = loss_and_grads(model, losses.CachedGISTEmbedLoss(model, guide, mini_batch_size=3), columns, train=False)
    reference = loss_and_grads(model, upstream.GISTEmbedLoss(model, guide), columns, train=False)
    assert_adapter_grads_only(model, reference)
    assert_same_grads(cached, reference)


@pytest.mark.parametrize("wrapper", ["adaptive-layer", "matryoshka-2d"])
def test_layer_wise_wrappers_adapter_grads_equal_uncached(decoder_dirs, saved_adapters, wrapper):
    model = adapted(decoder_dirs, saved_adapters, "qwen3")
    columns = decoder_columns()
    inner = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3)
    plain = upstream.MultipleNegativesRankingLoss(model)
    if wrapper == "adaptive-layer":
        ours, reference_loss = (
            losses.AdaptiveLayerLoss(model, inner, n_layers_per_step=-1),
            upstream.AdaptiveLayerLoss(model, plain, n_layers_per_step=-1),
        )
    else:
        ours, reference_loss = (
            losses.Matryoshka2dLoss(model, inner, DIMS, n_layers_per_step=-1),
            upstream.Matryoshka2dLoss(model, plain, DIMS, n_layers_per_step=-1),
        )
    reference = loss_and_grads(model, reference_loss, columns, train=False)
    assert_adapter_grads_only(model, reference)
    assert_same_grads(loss_and_grads(model, ours, columns, train=False), reference)


def test_cross_batch_memory_adapter_grads_equal_loss_over_batch_and_queue(decoder_dirs, saved_adapters):
    """After two batches fill the queue, the cached loss's gradients equal a by-hand MNRL over the batch's
    documents and the (detached) queue."""
    from sentence_transformers.util import cos_sim
    from test_cross_batch_memory import fill

    from st_ext.losses.cross_batch_memory import CrossBatchMemoryLoss

    model = adapted(decoder_dirs, saved_adapters, "qwen3")
    loss = CrossBatchMemoryLoss(model, losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3), 32)
    fill(loss, decoder_columns(seed=1))
    fill(loss, decoder_columns(seed=2))
    queue = loss.memory_embeddings.clone()
    assert len(queue) == 2 * BATCH

    def by_hand(features, labels):
        anchors, documents = (model(f)["sentence_embedding"] for f in features)
        scores = cos_sim(anchors, torch.cat([documents, queue])) * 20.0
        return torch.nn.functional.cross_entropy(scores, torch.arange(len(scores)))

    columns = decoder_columns(seed=3)
    reference = loss_and_grads(model, by_hand, columns, train=False)
    assert_adapter_grads_only(model, reference)
    assert_same_grads(loss_and_grads(model, loss, columns, train=False), reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_mini_batch_and_kept_graphs_adapter_grads_within_budget(decoder_dirs, saved_adapters, family):
    """``"auto"`` under a budget between the steps of mini-batches of 8 and 16 rows takes 8 and stays within the
    budget on the meter (the step that measures included); it, and a fixed size keeping graphs, give the
    uncached gradients."""
    model = adapted(decoder_dirs, saved_adapters, family)
    columns = with_query_prompt(text_columns(16, 2, min_words=10, max_words=14))
    features = features_of(model, columns)

    def step_peak(loss) -> int:
        model.zero_grad(set_to_none=True)
        with measure_peak("cpu") as peak:
            loss(features, None).backward()
        model.zero_grad(set_to_none=True)
        return peak.peak_bytes

    at_8 = step_peak(losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=8))
    at_16 = step_peak(losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=16))
    budget = (at_8 + at_16) / 2
    auto = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size="auto", memory_budget_mb=budget / 2**20)
    assert step_peak(auto) <= budget, "the first step, which measures, stays within the budget"
    assert step_peak(auto) <= budget, auto.auto_mini_batch.choice
    assert auto.auto_mini_batch.choice.size == 8, auto.auto_mini_batch.choice
    reference = loss_and_grads(model, upstream.MultipleNegativesRankingLoss(model), columns, train=False)
    assert_adapter_grads_only(model, reference)
    assert_same_grads(loss_and_grads(model, auto, columns, train=False), reference)
    kept = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=4, kept_graphs=2)
    assert_same_grads(loss_and_grads(model, kept, columns, train=False), reference)


# ---------------------------------------------------------------------------------------------
# Flattened (padding-free) inputs


def causal_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention within each sequence of a flattened batch, as flash-attention's variable-length kernel
    runs a decoder: ``query`` is ``(1, heads, tokens, head_dim)``, ``key``/``value`` have the key-value heads
    (grouped-query attention)."""
    bounds = kwargs["cu_seq_lens_q"].tolist()
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    output = torch.empty_like(query)
    for begin, end in zip(bounds[:-1], bounds[1:]):
        output[:, :, begin:end] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, begin:end], key[:, :, begin:end], value[:, :, begin:end], is_causal=True, scale=scaling
        )
    return output.transpose(1, 2).contiguous(), None


def flattening(model):
    """``model`` switched to flattened inputs through :func:`causal_varlen_attention` (tests/varlen_attention.py's
    switch, whose own kernel attends both ways, as an encoder does); skips where transformers will not run the
    architecture through a registered attention function."""
    from unittest import mock

    import transformers
    import varlen_attention

    with (
        mock.patch.object(varlen_attention, "varlen_attention", causal_varlen_attention),
        mock.patch.object(varlen_attention, "VARLEN_ATTENTION", "causal_varlen_sdpa"),
    ):
        try:
            return varlen_attention.make_flattening(model)
        except ValueError as error:
            pytest.skip(f"transformers {transformers.__version__} runs no registered attention here: {error}")


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_loss_on_flattened_inputs_gives_the_padded_adapter_grads(decoder_dirs, saved_adapters, family):
    """A cached Matryoshka MNRL over flattened rows (no padding; each query's instruction included) gives the
    adapter the gradients of the same loss over left-padded rows: the sequence boundaries, the positions and
    the last token of every row survive flattening and the engine's slicing of it."""
    from varlen_attention import flattening_supported

    from st_ext._compat import preprocess
    from st_ext.losses.features import is_flattened

    if not flattening_supported():
        pytest.skip("sentence-transformers flattens inputs for a registered attention from 6.0 on")
    padded = adapted(decoder_dirs, saved_adapters, family)
    flat = flattening(adapted(decoder_dirs, saved_adapters, family))
    columns = decoder_columns(3)
    assert is_flattened(preprocess(flat, columns[0])) and not is_flattened(preprocess(padded, columns[0]))

    def loss_for(model):
        return losses.MatryoshkaLoss(model, losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3), DIMS)

    reference = loss_and_grads(padded, loss_for(padded), columns, train=False)
    assert_adapter_grads_only(padded, reference)
    assert_same_grads(loss_and_grads(flat, loss_for(flat), columns, train=False), reference)


# ---------------------------------------------------------------------------------------------
# Checkpointing and bf16


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("attach", ATTACH)
def test_checkpointing_keeps_the_adapter_grads(decoder_dirs, saved_adapters, attach, reentrant):
    """Frozen input embeddings give the checkpointed layers no input that requires grad; the adapter still gets
    the gradients of the uncached loss without checkpointing, re-entrant or not, and switching it off leaves
    no hook behind."""
    model = adapted(decoder_dirs, saved_adapters, "qwen3", attach)
    columns = decoder_columns()
    reference = loss_and_grads(model, upstream.MultipleNegativesRankingLoss(model), columns, train=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert model.is_gradient_checkpointing
    cached = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3)
    assert_same_grads(loss_and_grads(model, cached, columns, train=True), reference)
    assert_same_grads(
        loss_and_grads(model, upstream.MultipleNegativesRankingLoss(model), columns, train=True), reference
    )
    model.gradient_checkpointing_disable()
    assert not model.is_gradient_checkpointing


def test_bf16_autocast_cached_adapter_grads_match_uncached(decoder_dirs, saved_adapters):
    """Under CPU bf16 autocast both losses round alike; their adapter gradients agree to bf16 precision."""
    model = adapted(decoder_dirs, saved_adapters, "qwen3")
    columns = decoder_columns()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cached = loss_and_grads(
            model, losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=3), columns, train=False
        )
        reference = loss_and_grads(model, upstream.MultipleNegativesRankingLoss(model), columns, train=False)
    assert_adapter_grads_only(model, reference)
    torch.testing.assert_close(cached[0], reference[0], rtol=1e-2, atol=0)
    for name, grad in reference[1].items():
        assert (cached[1][name] - grad).norm() <= 2e-2 * grad.norm(), name


# ---------------------------------------------------------------------------------------------
# Saving and reloading


@pytest.mark.parametrize("attach", ATTACH)
@pytest.mark.parametrize("family", FAMILIES)
def test_save_writes_the_adapter_and_reload_encodes_identically(
    decoder_dirs, saved_adapters, tmp_path, family, attach
):
    """The saved folder holds the adapter as peft writes it (config naming the base model, weights of the
    adapter only), upstream's loader and st_ext's adapter loader both reload it, and both encode as the
    model that was saved."""
    from st_ext import SentenceTransformer

    model = adapted(decoder_dirs, saved_adapters, family, attach)
    model.save(str(tmp_path))
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and sorted(config["target_modules"]) == LORA_TARGETS
    assert config["base_model_name_or_path"] == str(decoder_dirs[family])
    assert not (tmp_path / "model.safetensors").exists()
    from safetensors.torch import load_file

    assert all("lora_" in key for key in load_file(tmp_path / "adapter_model.safetensors"))

    texts = ["the cat is in the house", "rank the passage for the query"]
    expected = model.encode(texts, prompt_name="query", convert_to_tensor=True)
    reloaded = SentenceTransformer(str(tmp_path), device="cpu")
    assert torch.equal(reloaded.encode(texts, prompt_name="query", convert_to_tensor=True), expected)
    fresh = decoder_embedder(decoder_dirs[family])
    load_lora_adapter(fresh, tmp_path, trainable=False)
    assert torch.equal(fresh.encode(texts, prompt_name="query", convert_to_tensor=True), expected)
    assert not adapter_names(fresh)


def test_add_lora_adapter_takes_the_way_the_installed_versions_allow(decoder_dirs):
    model = decoder_embedder(decoder_path(decoder_dirs, "qwen3"))
    runner = add_lora_adapter(model, lora_config())
    assert (runner is model[0].auto_model) and adapter_names(model)
    assert callable(getattr(runner, "get_base_model", None)) is not transformers_accepts_peft()
    if not transformers_accepts_peft():
        with pytest.raises(ValueError, match="already runs a peft adapter"):
            add_lora_adapter(model, lora_config())


def test_missing_adapter_folder_is_one_clear_error(decoder_dirs, tmp_path):
    model = decoder_embedder(decoder_path(decoder_dirs, "qwen3"))
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        load_lora_adapter(model, tmp_path)
