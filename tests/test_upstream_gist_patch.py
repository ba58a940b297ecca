"""
The GIST patch in ``patches/sentence-transformers/<version>/0003-*.patch`` (the guide runs on its own device),
applied to the released sources of the installed version after the patches before it.

As in ``test_upstream_patches``, the same checks run in fresh interpreters (this file run as a script): on the
installed, unpatched package and with ``PYTHONPATH`` pointing at the patched tree, and the tests compare the two.
On the CPU, with model and guide on one device, the patched losses must give exactly the loss and the gradients of
the released ones. On a CUDA machine, with the model on the GPU and the guide on the CPU, the released losses fail
with a device mismatch and the patched ones give the loss of a guide on the GPU.
"""

from __future__ import annotations

import json
import sys
import tempfile
from functools import partial
from importlib.metadata import version
from pathlib import Path

import pytest
from _upstream_source import (
    apply_patch,
    collect_check_script,
    patch_files,
    patched_source,
    sdist_path,
    start_check_script,
    unpack_sdist,
)
from tiny_models import SENTENCES

PACKAGE = "sentence-transformers"
# The installed distribution's version, read without importing the package (that takes seconds).
INSTALLED = version(PACKAGE)
PATCHED_VERSIONS = ("4.1.0", "6.2.0")
GIST_PATCH_PREFIX = "0003-"

pytestmark = pytest.mark.skipif(
    INSTALLED not in PATCHED_VERSIONS,
    reason=f"patches/{PACKAGE}/ has patches for {', '.join(PATCHED_VERSIONS)} only; {INSTALLED} is installed",
)

LOSSES = ("GISTEmbedLoss", "CachedGISTEmbedLoss")
# A guide with the model's vocabulary gets the model's features; one with a shorter max_seq_length must retokenize.
GUIDES = {"shared_tokenizer": 32, "retokenize": 16}
# Anchor, positive and negative columns of four texts each, no text twice.
COLUMNS = [SENTENCES[:4], SENTENCES[4:], [SENTENCES[i] + " and the car" for i in (1, 3, 5, 7)]]
# Where the cuda checks put the model and the reference guide.
ACCELERATOR = "cuda"

# ---------------------------------------------------------------------------------------------------------------
# The checks, run in a subprocess. Imports are local: collecting the tests must not import sentence_transformers.
# ---------------------------------------------------------------------------------------------------------------


def attempt(step) -> dict:
    """Run one step and record its result or its error, so that the unpatched run reports every failure."""
    try:
        return {"result": step()}
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


def losses_module():
    """The losses module of the installed generation (6.x moved it, keeping a deprecated alias)."""
    try:
        from sentence_transformers.sentence_transformer import losses
    except ImportError:
        from sentence_transformers import losses
    return losses


def load_models(work_dir: Path) -> tuple:
    """The model, and one guide per entry of GUIDES: different tiny BERTs with the same vocabulary."""
    from sentence_transformers import SentenceTransformer
    from tiny_models import save_tiny_bert

    model = SentenceTransformer(str(save_tiny_bert(work_dir / "model", seed=0)), device="cpu")
    model.max_seq_length = 32
    guides = {}
    for seed, (name, max_seq_length) in enumerate(GUIDES.items(), start=1):
        guide = SentenceTransformer(str(save_tiny_bert(work_dir / f"guide_{name}", seed=seed)), device="cpu")
        guide.max_seq_length = max_seq_length
        guide.eval()
        guides[name] = guide
    return model, guides


def features_on(model, device) -> list[dict]:
    """The model's features of COLUMNS on ``device``, as the trainer's collator would give them."""
    from sentence_transformers.util import batch_to_device

    tokenize = getattr(model, "preprocess", model.tokenize)
    return [batch_to_device(tokenize(texts), device) for texts in COLUMNS]


def make_loss(name: str, model, guide):
    kwargs = {"mini_batch_size": 2} if name.startswith("Cached") else {}
    return getattr(losses_module(), name)(model, guide, **kwargs)


def loss_and_gradients(loss, model, device) -> dict:
    """
    One forward and backward pass from a fixed seed (the model trains, with dropout). Returns the loss exactly
    (``float.hex``), and the model's gradients as a digest of their bytes plus their norm.
    """
    import hashlib

    import torch

    model.train()
    model.zero_grad(set_to_none=True)
    features = features_on(model, device)
    torch.manual_seed(0)
    value = loss(features, None)
    value.backward()
    grads = {name: param.grad for name, param in model.named_parameters() if param.grad is not None}
    flat = torch.cat([grad.detach().flatten().cpu() for grad in grads.values()])
    return {
        "loss": value.item(),
        "loss_hex": value.item().hex(),
        "loss_device": str(value.device),
        "must_retokenize": bool(loss.must_retokenize),
        "grad_params": len(grads),
        "grad_norm": flat.norm().item(),
        "grad_sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
    }


def model_outputs_kept(model, guide) -> bool:
    """
    Whether the features the model filled still hold the model's embedding (with gradient) after GISTEmbedLoss
    ran the guide. On 6.x the model fills only the anchors' dict; the other columns run merged into a new one.
    """
    loss = make_loss("GISTEmbedLoss", model, guide)
    features = features_on(model, model.device)
    loss(features, None)
    filled = [feature for feature in features if "sentence_embedding" in feature]
    assert filled, "the model filled none of the feature dicts"
    return all(feature["sentence_embedding"].requires_grad for feature in filled)


def matryoshka_losses(model, guide) -> dict:
    """
    MatryoshkaLoss(GISTEmbedLoss) over dimensions 32 and 16, and the same two dimensions each in a loss of its
    own: the sum of the two must equal the first when every dimension uses the model's embeddings.
    """
    import torch

    losses = losses_module()
    model.eval()  # no dropout: the three losses must see the same embeddings
    values = {}
    with torch.no_grad():
        for label, dims in {"both": [32, 16], "only_32": [32], "only_16": [16]}.items():
            loss = losses.MatryoshkaLoss(model, make_loss("GISTEmbedLoss", model, guide), matryoshka_dims=dims)
            values[label] = loss(features_on(model, model.device), None).item()
    return values


def run_cpu_checks(work_dir: Path) -> dict:
    """Every loss with every guide, model and guide on the CPU, plus the features and Matryoshka checks."""
    model, guides = load_models(work_dir)
    observed = {}
    for loss_name in LOSSES:
        for guide_name, guide in guides.items():
            loss = make_loss(loss_name, model, guide)
            observed[f"{loss_name}.{guide_name}"] = attempt(partial(loss_and_gradients, loss, model, "cpu"))
    observed["model_outputs_kept"] = attempt(lambda: model_outputs_kept(model, guides["shared_tokenizer"]))
    observed["matryoshka"] = attempt(lambda: matryoshka_losses(model, guides["shared_tokenizer"]))
    return observed


def run_cuda_checks(work_dir: Path) -> dict:
    """Every loss with every guide, the model on CUDA and the guide on the CPU, then with the guide on CUDA."""
    model, guides = load_models(work_dir)
    model.to(ACCELERATOR)
    observed = {}
    for label, guide_device in (("cpu", "cpu"), ("cuda", ACCELERATOR)):
        for guide_name, guide in guides.items():
            guide.to(guide_device)
            for loss_name in LOSSES:
                loss = make_loss(loss_name, model, guide)
                outcome = attempt(partial(loss_and_gradients, loss, model, ACCELERATOR))
                observed[f"{loss_name}.{guide_name}.guide_on_{label}"] = outcome
                # The guide must stay where it was put: the losses must not move it.
                observed[f"{loss_name}.{guide_name}.guide_on_{label}.guide_device"] = str(guide.device)
    return observed


def main() -> None:
    """Entry point of the subprocess: print the observations as JSON on the last line of stdout."""
    import sentence_transformers
    import torch

    torch.set_num_threads(1)
    checks = {"cpu": run_cpu_checks, "cuda": run_cuda_checks}[sys.argv[1]]
    with tempfile.TemporaryDirectory() as work_dir:
        observed = checks(Path(work_dir))
    observed["version"] = sentence_transformers.__version__
    observed["module_file"] = sentence_transformers.__file__
    print(json.dumps(observed))


# ---------------------------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------------------------


def gist_patch() -> Path:
    """The GIST patch of the installed version; fails if there is not exactly one."""
    found = [path for path in patch_files(PACKAGE, INSTALLED) if path.name.startswith(GIST_PATCH_PREFIX)]
    assert len(found) == 1, f"expected one {GIST_PATCH_PREFIX}*.patch in patches/{PACKAGE}/{INSTALLED}/: {found}"
    return found[0]


def run_both(mode: str, patched_tree: Path, log_root: Path) -> dict[str, dict]:
    """The observations on the released and on the patched package, both runs side by side."""
    sources = {"released": None, "patched": patched_tree}
    processes = {
        label: start_check_script(__file__, source, log_root / label, mode) for label, source in sources.items()
    }
    runs = {label: collect_check_script(process, log_root / label) for label, process in processes.items()}
    assert runs["released"]["version"] == runs["patched"]["version"] == INSTALLED
    assert Path(runs["patched"]["module_file"]).resolve().is_relative_to(patched_tree.resolve())
    assert not Path(runs["released"]["module_file"]).resolve().is_relative_to(patched_tree.resolve())
    return runs


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory) -> Path:
    """The released sources of the installed version with its series applied up to the GIST patch: a later patch
    may change the losses' rounding (6.2.0's 0007 computes the similarities differently), which the exact
    comparisons below would take for the GIST patch's."""
    patches = patch_files(PACKAGE, INSTALLED)
    assert gist_patch() in patches
    patches = patches[: patches.index(gist_patch()) + 1]
    return patched_source(PACKAGE, INSTALLED, patches, tmp_path_factory.mktemp("source"))


@pytest.fixture(scope="module")
def cpu_runs(patched_tree: Path, tmp_path_factory) -> dict[str, dict]:
    return run_both("cpu", patched_tree, tmp_path_factory.mktemp("cpu_runs"))


def result(observed: dict, key: str):
    """The result of one check, failing with the recorded error if it raised."""
    outcome = observed[key]
    if "error" in outcome:
        pytest.fail(f"{key}: {outcome['error']}")
    return outcome["result"]


def test_gist_patch_applies_after_the_others_and_alone(patched_tree: Path, tmp_path: Path) -> None:
    patch = gist_patch()
    # In the series: the lines it adds are in the patched tree.
    if INSTALLED == "4.1.0":
        losses_dir = patched_tree / "sentence_transformers" / "losses"
        files = [losses_dir / "GISTEmbedLoss.py", losses_dir / "CachedGISTEmbedLoss.py"]
    else:
        losses_dir = patched_tree / "sentence_transformers" / "sentence_transformer" / "losses"
        files = [losses_dir / "gist_embed.py", losses_dir / "cached_gist_embed.py"]
    for path in files:
        assert "The guide may be on another device than the model" in path.read_text(), path
    # On its own: it touches no file of the patches before it.
    root = unpack_sdist(sdist_path(PACKAGE, INSTALLED), tmp_path)
    apply_patch(root, patch)
    # Made against the sdist's CRLF files: every context and added line of their diffs ends in CRLF (its tests
    # are in the repository's tests/, which the sdist does not ship, with LF line endings).
    changed = [
        part
        for part in patch.read_bytes().split(b"\ndiff --git ")[1:]
        if b"\nnew file mode" not in part and not part.startswith(b"a/tests/")
    ]
    code_lines = [
        line
        for part in changed
        for line in part.split(b"\n")
        if line[:1] in (b" ", b"+") and not line.startswith(b"+++")
    ]
    assert code_lines and all(line.endswith(b"\r") for line in code_lines)


@pytest.mark.parametrize("guide_name", list(GUIDES))
@pytest.mark.parametrize("loss_name", LOSSES)
def test_same_device_loss_and_gradients_unchanged(cpu_runs: dict[str, dict], loss_name: str, guide_name: str) -> None:
    key = f"{loss_name}.{guide_name}"
    released, patched = result(cpu_runs["released"], key), result(cpu_runs["patched"], key)
    assert patched["must_retokenize"] is (guide_name == "retokenize")
    # A real training signal, not a degenerate one that any change would leave equal.
    assert patched["grad_params"] > 10 and patched["grad_norm"] > 0
    assert patched["loss"] > 0
    assert patched["loss_hex"] == released["loss_hex"]
    assert patched["grad_sha256"] == released["grad_sha256"]


def test_guides_differ(cpu_runs: dict[str, dict]) -> None:
    """The two guides give different losses: each check above sees its own guide."""
    for loss_name in LOSSES:
        losses = {result(cpu_runs["patched"], f"{loss_name}.{guide}")["loss_hex"] for guide in GUIDES}
        assert len(losses) == len(GUIDES)


def test_guide_no_longer_overwrites_the_model_outputs(cpu_runs: dict[str, dict]) -> None:
    assert result(cpu_runs["patched"], "model_outputs_kept") is True
    # 4.1.0 ran the guide on the dicts the model filled; 6.x already runs it on shallow copies.
    assert result(cpu_runs["released"], "model_outputs_kept") is (INSTALLED != "4.1.0")


def test_matryoshka_of_gist_uses_the_model_embeddings(cpu_runs: dict[str, dict]) -> None:
    patched = result(cpu_runs["patched"], "matryoshka")
    assert patched["both"] == pytest.approx(patched["only_32"] + patched["only_16"], rel=1e-6)
    released = result(cpu_runs["released"], "matryoshka")
    if INSTALLED == "4.1.0":
        # The released loss took the guide's embeddings for the model's at 16 dimensions.
        assert released["both"] != pytest.approx(released["only_32"] + released["only_16"], rel=1e-3)
    else:
        assert released == patched


@pytest.mark.cuda
def test_guide_on_cpu_model_on_cuda(patched_tree: Path, tmp_path: Path) -> None:
    runs = run_both("cuda", patched_tree, tmp_path)
    for loss_name in LOSSES:
        for guide_name in GUIDES:
            key = f"{loss_name}.{guide_name}"
            # The losses leave the guide where it is.
            for run in runs.values():
                assert run[f"{key}.guide_on_cpu.guide_device"] == "cpu"
                assert run[f"{key}.guide_on_cuda.guide_device"].startswith("cuda")
            on_cuda = result(runs["patched"], f"{key}.guide_on_cuda")
            on_cpu = result(runs["patched"], f"{key}.guide_on_cpu")
            assert on_cpu["loss_device"].startswith("cuda") and on_cpu["grad_norm"] > 0
            assert on_cpu["must_retokenize"] is (guide_name == "retokenize")
            assert on_cpu["loss"] == pytest.approx(on_cuda["loss"], rel=1e-4, abs=1e-5)
            assert on_cpu["grad_norm"] == pytest.approx(on_cuda["grad_norm"], rel=1e-3)
            # With both on CUDA the patch changes nothing.
            released_on_cuda = result(runs["released"], f"{key}.guide_on_cuda")
            assert on_cuda["loss"] == pytest.approx(released_on_cuda["loss"], rel=1e-6)
        # Released: the guide gets the model's CUDA features and fails in its first layer.
        error = runs["released"][f"{loss_name}.shared_tokenizer.guide_on_cpu"].get("error", "")
        assert error.startswith("RuntimeError") and "device" in error, error


if __name__ == "__main__":
    main()
