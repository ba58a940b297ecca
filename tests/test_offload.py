"""Offload, on-device blocks, release and the leftover check of st_ext.offload.

Memory is measured as process RSS. transformers maps the safetensors file, so parameters are
file-backed pages that count in RSS only once touched, and every parameter's storage points into
that one mapping: the fresh-process test touches every tensor before measuring, and a planted
reference to one parameter must keep the memory resident (the meter has to be able to fail).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from st_ext.offload import (
    GUIDE_EMBEDDING_COLUMN_TEMPLATE,
    DispatchedModuleError,
    LeftoverError,
    ReleasedModuleError,
    TrainableModuleError,
    assert_released,
    embedding_column_name,
    is_released,
    leftovers,
    offload,
    on_device,
    onload,
    precompute_embeddings,
    release,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

#: RSS must drop by at least this share of the parameter bytes (RSS also moves with other
#: allocations of the process; measured drops are 101-112 % of the parameter bytes).
RSS_DROP_SHARE = 0.9


def load_minilm(path: str, *, frozen: bool = True):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    return model.requires_grad_(not frozen)


def tokenized(model, texts):
    """Model inputs for ``texts``: ``tokenize`` is called ``preprocess`` from sentence-transformers 5.4."""
    tokenize = getattr(model, "preprocess", None) or model.tokenize
    return tokenize(texts)


def weak_references(module: nn.Module) -> list[weakref.ref]:
    return [weakref.ref(tensor) for tensor in [*module.parameters(), *module.buffers()]]


def small_frozen_mlp() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model.register_buffer("scale", torch.full((4,), 2.0))
    return model.requires_grad_(False)


class FakeLoss(nn.Module):
    """A loss that keeps its guide, like CachedGISTEmbedLoss does."""

    def __init__(self, guide: nn.Module):
        super().__init__()
        self.guide = guide


# --------------------------------------------------------------------------- release frees memory

RELEASE_IN_FRESH_PROCESS = textwrap.dedent(
    """
    import gc, json, os, sys, weakref
    import torch
    from sentence_transformers import SentenceTransformer
    from st_ext.offload import leftovers, process_rss_bytes, release

    def load():
        model = SentenceTransformer(sys.argv[1], device="cpu").requires_grad_(False)
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                tensor.float().sum()  # fault every page of the mapped weights in
        return model

    def parameter_bytes(model):
        return sum(p.numel() * p.element_size() for p in model.parameters())

    clean, planted = load(), load()
    total = parameter_bytes(clean)
    refs = [weakref.ref(t) for t in [*clean.parameters(), *clean.buffers()]]
    gc.collect()
    before = process_rss_bytes()
    clean_report = release(clean)
    after = process_rss_bytes()

    largest_name = max(planted.named_parameters(), key=lambda item: item[1].numel())[0]
    keeper = {"kept": planted.get_parameter(largest_name)}
    pinned = keeper["kept"].numel() * keeper["kept"].element_size()
    before_planted = process_rss_bytes()
    planted_report = release(planted)
    after_planted = process_rss_bytes()
    keeper.clear()
    cleared_check = leftovers(planted_report)
    after_cleared = process_rss_bytes()

    print(json.dumps({
        "parameter_bytes": total,
        "alive": sum(ref() is not None for ref in refs),
        "drop": before - after,
        "clean_ok": clean_report.ok,
        "largest_name": largest_name,
        "pinned_bytes": pinned,
        "planted_leftovers": planted_report.check.leftover_names,
        "planted_text": str(planted_report),
        "drop_with_leftover": before_planted - after_planted,
        "drop_after_clearing": after_planted - after_cleared,
        "cleared_ok": cleared_check.ok,
    }))
    """
)


@pytest.fixture(scope="module")
def fresh_process_release(minilm_path):
    """Release two copies of all-MiniLM-L6-v2 in a fresh process (its RSS is not shared with
    other tests): one cleanly, one with a planted reference to its largest parameter."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    completed = subprocess.run(
        [sys.executable, "-c", RELEASE_IN_FRESH_PROCESS, minilm_path],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_release_of_minilm_kills_every_tensor_and_returns_its_memory(fresh_process_release):
    result = fresh_process_release
    assert result["alive"] == 0
    assert result["clean_ok"]
    assert result["drop"] >= RSS_DROP_SHARE * result["parameter_bytes"], result


def test_one_planted_reference_keeps_memory_and_is_named(fresh_process_release):
    result = fresh_process_release
    assert result["planted_leftovers"] == [result["largest_name"]], result["planted_text"]
    assert "['kept']" in result["planted_text"], result["planted_text"]
    # At least the planted tensor stays resident (with mapped weights, all of them do) ...
    assert result["drop_with_leftover"] <= result["parameter_bytes"] - RSS_DROP_SHARE * result["pinned_bytes"], result
    # ... until the reference goes.
    assert result["drop_after_clearing"] >= RSS_DROP_SHARE * result["pinned_bytes"], result
    assert result["cleared_ok"]


# --------------------------------------------------------------------------- release in process


def test_release_kills_weak_references_and_guards_every_entry_point(minilm_path):
    model = load_minilm(minilm_path)
    refs = weak_references(model)
    report = release(model)

    assert report.ok, str(report)
    assert all(ref() is None for ref in refs)
    assert all(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()])
    assert is_released(model)
    assert "fully released" in str(report)
    with pytest.raises(ReleasedModuleError, match="was released.*Load it again.*SentenceTransformer\\("):
        model.encode(["a sentence"])
    with pytest.raises(ReleasedModuleError, match=re.escape(minilm_path)):
        model(tokenized(model, ["a sentence"]))


def test_a_released_model_is_neither_saved_nor_moved(minilm_path, tmp_path):
    """Saving would write a folder of meta tensors (torch's error half-way through), moving fail the same way."""
    model = load_minilm(minilm_path)
    release(model)
    for action in (lambda: model.save(str(tmp_path / "saved")), lambda: model.to("cpu"), lambda: model.cpu()):
        with pytest.raises(ReleasedModuleError, match="was released"):
            action()
    assert not (tmp_path / "saved").exists()


def test_release_of_plain_hugging_face_model_names_how_to_reload_it(tiny_bert_dir):
    from transformers import BertModel

    model = BertModel.from_pretrained(str(tiny_bert_dir)).requires_grad_(False)
    refs = weak_references(model)
    assert release(model).ok
    assert all(ref() is None for ref in refs)
    with pytest.raises(ReleasedModuleError, match=r"BertModel\.from_pretrained\("):
        model(input_ids=torch.tensor([[2, 5, 3]]))


def test_release_clears_references_on_holders_and_reports_them():
    model = small_frozen_mlp()
    loss = FakeLoss(model)
    loss.first_weight = model[0].weight  # a plain attribute pointing at a parameter
    trainer_state = {"guide": model, "step": 3, "encode": model.forward}
    refs = weak_references(model)

    report = release(model, holders=[loss, trainer_state])

    assert loss.guide is None and loss.first_weight is None
    assert trainer_state == {"guide": None, "step": 3, "encode": None}
    assert set(report.cleared) == {"FakeLoss.guide", "FakeLoss.first_weight", "dict['guide']", "dict['encode']"}
    assert "FakeLoss.guide" in str(report)
    assert report.ok and all(ref() is None for ref in refs)


def test_release_removes_hooks_and_gradients():
    model = small_frozen_mlp()
    model[2].weight.grad = torch.ones_like(model[2].weight)
    grad_ref = weakref.ref(model[2].weight.grad)
    kept = {"output": None}
    model[0].register_forward_hook(lambda module, args, output: kept.update(output=output))
    model.register_full_backward_hook(lambda module, grad_input, grad_output: None)
    refs = weak_references(model)

    report = release(model)

    assert report.module_hooks_removed == 2
    assert report.ok and all(ref() is None for ref in refs) and grad_ref() is None
    assert all(not submodule._forward_hooks and not submodule._backward_hooks for submodule in model.modules())


# --------------------------------------------------------------------------- planted leftovers


def test_check_finds_a_parameter_held_by_a_hook_closure_on_another_module(minilm_path):
    model = load_minilm(minilm_path)
    name = next(iter(model.named_parameters()))[0]
    student = nn.Linear(2, 2)

    def hook_keeping(guide_weight):
        def add_guide_norm(module, args, output):
            return output + guide_weight.norm()

        return add_guide_norm

    student.register_forward_hook(hook_keeping(model.get_parameter(name)))

    report = release(model)

    assert report.check.leftover_names == [name]
    (leftover,) = report.check.leftovers
    assert "Linear._forward_hooks" in leftover.held_by[0]
    assert "closure variable 'guide_weight' of" in leftover.held_by[0]
    with pytest.raises(LeftoverError, match=name):
        assert_released(model)


def test_check_names_a_hook_lambdas_default_argument(minilm_path):
    model = load_minilm(minilm_path)
    name = next(iter(model.named_parameters()))[0]
    student = nn.Linear(2, 2)
    student.register_forward_hook(lambda module, args, output, kept=model.get_parameter(name): output + kept.norm())

    report = release(model)

    (leftover,) = report.check.leftovers
    assert "Linear._forward_hooks" in leftover.held_by[0]
    assert "default argument 'kept' of" in leftover.held_by[0] and "<lambda>()" in leftover.held_by[0]


def test_check_finds_parameters_held_by_a_cached_output_with_a_graph(minilm_path):
    model = load_minilm(minilm_path, frozen=False)
    loss = FakeLoss(nn.Identity())
    loss.cached_output = model(tokenized(model, ["a sentence"]))["sentence_embedding"]
    assert loss.cached_output.grad_fn is not None

    report = release(model, force=True)

    fresh = load_minilm(minilm_path)
    names = [name for name, _ in [*fresh.named_parameters(), *fresh.named_buffers()]]
    in_graph = [
        name for name in names if name.endswith(("word_embeddings.weight", "layer.0.attention.self.query.weight"))
    ]
    assert len(in_graph) == 2 and set(in_graph) <= set(report.check.leftover_names), str(report)
    assert set(report.check.leftover_names) <= set(names)
    traced = [leftover for leftover in report.check.leftovers if "not traced" not in leftover.held_by[0]]
    assert traced and all("FakeLoss.cached_output" in leftover.held_by[0] for leftover in traced)
    assert all("autograd graph" in leftover.held_by[0] for leftover in traced)

    del loss.cached_output
    assert leftovers(model).ok


def test_check_finds_a_parameter_kept_in_a_loss_attribute(minilm_path):
    model = load_minilm(minilm_path)
    name = [name for name, _ in model.named_parameters()][-1]
    loss = FakeLoss(nn.Identity())
    loss.guide_weight = model.get_parameter(name)

    report = release(model)

    assert report.check.leftover_names == [name]
    assert report.check.leftovers[0].held_by == ["FakeLoss.guide_weight"]
    assert name in str(report)


def test_check_finds_memory_kept_by_a_detached_view():
    model = small_frozen_mlp()
    detached = {"copy": model[2].weight.detach()}  # a new tensor object sharing the storage
    report = release(model)

    assert report.check.leftover_names == ["2.weight"]
    leftover = report.check.leftovers[0]
    assert "shared by another live tensor" in leftover.how
    assert any("['copy']" in holder for holder in leftover.held_by)
    detached.clear()
    assert leftovers(model).ok


def test_check_refuses_a_module_that_was_not_released():
    with pytest.raises(ValueError, match="not released"):
        leftovers(small_frozen_mlp())


# --------------------------------------------------------------------------- on_device / offload


def test_on_device_output_equals_resident_output_and_restores_storages(minilm_path):
    model = load_minilm(minilm_path)
    resident = load_minilm(minilm_path)
    features = tokenized(model, ["on device", "and back again"])
    pointers = [tensor.data_ptr() for tensor in [*model.parameters(), *model.buffers()]]

    with on_device(model, "cpu") as placed:
        assert placed is model
        output = model(dict(features))["sentence_embedding"]
    with on_device(model, "meta"):  # a real move: every tensor leaves and must come back
        assert all(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()])

    assert torch.equal(output, resident(dict(features))["sentence_embedding"])
    assert [tensor.data_ptr() for tensor in [*model.parameters(), *model.buffers()]] == pointers
    assert torch.equal(model(dict(features))["sentence_embedding"], output)


def test_on_device_puts_the_module_back_when_the_forward_raises():
    model = small_frozen_mlp()
    placement = {name: (tensor.device, tensor.data_ptr()) for name, tensor in model.state_dict().items()}
    expected = model(torch.ones(1, 8))

    with pytest.raises(RuntimeError, match="forward failed"):
        with on_device(model, "meta"):
            model(torch.ones(1, 8, device="meta"))
            raise RuntimeError("forward failed")

    assert {name: (tensor.device, tensor.data_ptr()) for name, tensor in model.state_dict().items()} == placement
    assert torch.equal(model(torch.ones(1, 8)), expected)


def test_offload_moves_a_module_and_keeps_its_parameter_objects():
    model = small_frozen_mlp()
    parameters = list(model.parameters())
    assert offload(model) is model
    assert onload(model, "cpu") is model
    assert [id(param) for param in model.parameters()] == [id(param) for param in parameters]
    assert all(tensor.device.type == "cpu" for tensor in model.state_dict().values())


def test_offload_removes_accelerate_hooks_first():
    from accelerate.hooks import attach_align_device_hook

    model = small_frozen_mlp()
    expected = model(torch.ones(1, 8))
    attach_align_device_hook(model, execution_device="cpu")
    assert any(hasattr(submodule, "_hf_hook") for submodule in model.modules())

    offload(model)

    assert not any(hasattr(submodule, "_hf_hook") for submodule in model.modules())
    assert torch.equal(model(torch.ones(1, 8)), expected)


def test_offload_of_accelerate_cpu_offloaded_module_says_why_not():
    from accelerate import cpu_offload

    model = cpu_offload(small_frozen_mlp(), execution_device="cpu")
    with pytest.raises(DispatchedModuleError, match="accelerate.*'meta' placeholders"):
        offload(model)
    with pytest.raises(DispatchedModuleError):
        with on_device(model, "cpu"):
            pass
    assert release(model).ok  # releasing drops the hooks, and with them the weights


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "action",
    [
        lambda model, **kwargs: offload(model, **kwargs),
        lambda model, **kwargs: on_device(model, "cpu", **kwargs).__enter__(),
        lambda model, **kwargs: release(model, **kwargs),
    ],
    ids=["offload", "on_device", "release"],
)
def test_a_module_being_trained_is_refused_unless_forced(action):
    trainable = small_frozen_mlp().requires_grad_(True)
    with pytest.raises(TrainableModuleError, match=r"require grad.*requires_grad_\(False\).*force=True"):
        action(trainable)

    frozen = small_frozen_mlp()
    optimizer = torch.optim.SGD([frozen[0].weight], lr=0.1)
    with pytest.raises(TrainableModuleError, match="in an optimizer you passed.*'0.weight'"):
        action(frozen, optimizers=[optimizer])

    action(trainable, force=True)


def test_forced_release_takes_the_parameters_out_of_the_optimizer():
    model = small_frozen_mlp().requires_grad_(True)
    other = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.Adam([*model.parameters(), other])
    model(torch.ones(1, 8)).sum().backward()
    optimizer.step()
    refs = weak_references(model)

    report = release(model, optimizers=[optimizer], force=True)

    assert optimizer.param_groups[0]["params"] == [other]
    assert len(optimizer.state) == 0  # ``other`` got no gradient, so it has no state
    assert report.cleared == ["Adam: 4 parameters and their state"]
    assert report.ok and all(ref() is None for ref in refs)


def test_a_released_module_cannot_be_moved_or_released_again():
    model = small_frozen_mlp()
    release(model)
    for action in (lambda: offload(model), lambda: on_device(model, "cpu").__enter__(), lambda: release(model)):
        with pytest.raises(ReleasedModuleError, match="was released"):
            action()
    with pytest.raises(ReleasedModuleError, match="Load it again"):
        model(torch.ones(1, 8))


# --------------------------------------------------------------------------- precompute


def test_precompute_embeddings_adds_float32_columns_equal_to_encode_then_releases(minilm_path, capsys):
    from datasets import Dataset

    model = load_minilm(minilm_path)
    anchors = ["a cat", "the dog sits on the mat by the door", "rivers", "search", "a long sentence " * 5]
    positives = ["a kitten", "a puppy", "a stream", "find", "short"]
    dataset = Dataset.from_dict({"anchor": anchors, "positive": positives, "label": [1, 0, 1, 0, 1]})
    expected = {
        column: model.encode(texts, batch_size=2) for column, texts in (("anchor", anchors), ("positive", positives))
    }
    refs = weak_references(model)

    result = precompute_embeddings(model, dataset, ["anchor", "positive"], batch_size=2, release_encoder=True)

    assert capsys.readouterr().err.count("Precomputing embeddings") >= 1
    assert result.column_names == ["anchor", "positive", "label", "anchor_guide_emb", "positive_guide_emb"]
    assert result.features["anchor_guide_emb"].feature.dtype == "float32"
    for column in ("anchor", "positive"):
        stored = torch.tensor(result[embedding_column_name(column)])
        assert torch.allclose(stored, torch.from_numpy(expected[column]), atol=1e-5)
    assert is_released(model) and all(ref() is None for ref in refs)


def test_precompute_embeddings_names_columns_by_template(minilm_path):
    from datasets import Dataset

    model = load_minilm(minilm_path)
    dataset = Dataset.from_dict({"query": ["a", "b", "c"]})
    result = precompute_embeddings(
        model, dataset, "query", batch_size=2, output_column_template="{column}_teacher", show_progress_bar=False
    )
    assert result.column_names == ["query", "query_teacher"]
    assert len(result[0]["query_teacher"]) == model.get_sentence_embedding_dimension()
    assert not is_released(model)
    assert GUIDE_EMBEDDING_COLUMN_TEMPLATE.format(column="query") == embedding_column_name("query")


class CountingEncoder(nn.Module):
    """An encoder that records its calls, to show refusals happen before any encoding."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 3)
        self.calls = 0

    def encode(self, texts, **kwargs):
        self.calls += 1
        return torch.zeros(len(texts), 3).numpy()


def test_precompute_embeddings_refuses_bad_input_before_encoding():
    from datasets import Dataset

    dataset = Dataset.from_dict(
        {"text": ["a", "b"], "anchor": ["a", "b"], "anchor_guide_emb": [[0.0], [1.0]], "mixed": ["a", None]}
    )
    encoder = CountingEncoder()
    with pytest.raises(TrainableModuleError):
        precompute_embeddings(encoder, dataset, ["text"], release_encoder=True, show_progress_bar=False)
    with pytest.raises(ValueError, match="batch_size"):
        precompute_embeddings(encoder, dataset, ["text"], batch_size=0, show_progress_bar=False)
    with pytest.raises(ValueError, match="not in the dataset"):
        precompute_embeddings(encoder, dataset, ["missing"], show_progress_bar=False)
    with pytest.raises(ValueError, match="already exist.*overwrite=True"):
        precompute_embeddings(encoder, dataset, ["anchor"], show_progress_bar=False)
    with pytest.raises(ValueError, match="must contain"):
        precompute_embeddings(encoder, dataset, ["mixed"], output_column_template="emb", show_progress_bar=False)
    with pytest.raises(TypeError, match="row 1 is NoneType"):
        precompute_embeddings(encoder, dataset, ["mixed"], show_progress_bar=False)
    with pytest.raises(TypeError, match=r"\.encode"):
        precompute_embeddings(nn.Linear(2, 2), dataset, ["anchor"], show_progress_bar=False)
    assert encoder.calls == 0


# --------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_returns_to_its_value_before_loading(minilm_path):
    from sentence_transformers import SentenceTransformer

    # A first encode allocates what the process keeps for good (cuBLAS workspaces), so warm up.
    warm_up = SentenceTransformer(minilm_path, device="cuda").requires_grad_(False)
    warm_up.encode(["warm up every kernel once"])
    release(warm_up)
    torch.cuda.synchronize()
    before_load = torch.cuda.memory_allocated()

    model = SentenceTransformer(minilm_path, device="cuda").requires_grad_(False)
    model.encode(["warm up every kernel once"])
    resident = SentenceTransformer(minilm_path, device="cuda").requires_grad_(False)
    offload(model)
    features = {
        key: value.cuda() if isinstance(value, torch.Tensor) else value
        for key, value in tokenized(model, ["on device"]).items()
    }
    before_block = torch.cuda.memory_allocated()
    with torch.no_grad(), on_device(model, "cuda"):
        assert all(tensor.is_cuda for tensor in [*model.parameters(), *model.buffers()])
        on_device_output = model(dict(features))["sentence_embedding"].cpu()
    assert all(tensor.device.type == "cpu" for tensor in [*model.parameters(), *model.buffers()])
    assert torch.cuda.memory_allocated() == before_block  # the device copies are gone
    with torch.no_grad():
        assert torch.equal(on_device_output, resident(dict(features))["sentence_embedding"].cpu())
    assert next(onload(model, "cuda").parameters()).is_cuda
    offload(model)
    del features

    report = release(resident)
    assert report.ok, str(report)
    release(model)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before_load
