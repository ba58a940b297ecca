"""
The patches in ``patches/sentence-transformers/<version>/``, applied to the released sources of the installed
version and checked by what they change.

The same checks run twice, each in a fresh interpreter (this file run as a script): on the installed, unpatched
package, and with ``PYTHONPATH`` pointing at the patched tree. Every test compares the two, so it shows both the
upstream gap and that the patch closes it. Models are the tiny local BERTs of ``tiny_models``; only the sdist is
downloaded.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from importlib.metadata import version
from pathlib import Path

import pytest
from _upstream_source import collect_check_script, patch_files, patched_source, start_check_script
from tiny_models import SENTENCES

PACKAGE = "sentence-transformers"
# The installed distribution's version, read without importing the package (that takes seconds).
INSTALLED = version(PACKAGE)
PATCHED_VERSIONS = ("4.1.0", "6.2.0")

pytestmark = pytest.mark.skipif(
    INSTALLED not in PATCHED_VERSIONS,
    reason=f"patches/{PACKAGE}/ has patches for {', '.join(PATCHED_VERSIONS)} only; {INSTALLED} is installed",
)

# ---------------------------------------------------------------------------------------------------------------
# The checks, run in a subprocess. Imports are local: collecting the tests must not import sentence_transformers.
# ---------------------------------------------------------------------------------------------------------------


def no_argument_module():
    """A module like a user's own, whose ``gradient_checkpointing_enable`` takes no arguments and counts calls."""
    import torch

    class NoArgumentCheckpointing(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enable_calls = 0

        def forward(self, features: dict) -> dict:
            return features

        def gradient_checkpointing_enable(self) -> None:
            self.enable_calls += 1

    return NoArgumentCheckpointing()


def attempt(step) -> dict:
    """Run one step and record its result or its error, so that the unpatched run reports every gap."""
    try:
        return {"result": step()}
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


def checkpointing_state(model) -> dict:
    """What the checkpointing submodules report: each Hugging Face model's flag, each custom module's calls."""
    from transformers import PreTrainedModel

    def hf_flag(hf_model) -> bool:
        # transformers 5.2x renamed the property and warns on the old name; older versions have only the old one.
        if hasattr(type(hf_model), "is_activation_checkpointing"):
            return hf_model.is_activation_checkpointing
        return hf_model.is_gradient_checkpointing

    modules = list(model.modules())
    return {
        "hf_models": [hf_flag(module) for module in modules if isinstance(module, PreTrainedModel)],
        "custom_enable_calls": [module.enable_calls for module in modules if hasattr(module, "enable_calls")],
    }


def call_then_state(model, method: str, **kwargs) -> dict:
    """Call ``model.<method>(**kwargs)`` and return the checkpointing state it leaves."""
    getattr(model, method)(**kwargs)
    return checkpointing_state(model)


def layer_runs_per_step(model, tokenizer) -> int:
    """
    How often the attention of the first encoder layer runs in one training forward and backward pass: twice
    when the layer is recomputed in the backward pass, i.e. when checkpointing really takes effect, once otherwise.
    The hook sits inside the layer because recent transformers versions keep the layer's own hooks out of the
    recomputation.
    """
    from transformers import PreTrainedModel

    hf_model = next(module for module in model.modules() if isinstance(module, PreTrainedModel))
    runs = []
    hook = hf_model.base_model.encoder.layer[0].attention.register_forward_hook(lambda *_: runs.append(1))
    hf_model.train()
    features = tokenizer(SENTENCES[:2], return_tensors="pt", padding=True)
    hf_model(**features)[0].sum().backward()
    hook.remove()
    return len(runs)


def check_methods(model, tokenizer, prefix: str, enable_kwargs: dict) -> dict:
    """
    Enable, use and disable checkpointing through ``<prefix>_checkpointing_enable`` / ``_disable`` and the
    ``is_<prefix>_checkpointing`` property, recording every step.
    """
    steps = {
        "enable": lambda: call_then_state(model, f"{prefix}_checkpointing_enable", **enable_kwargs),
        "property_on": lambda: getattr(model, f"is_{prefix}_checkpointing"),
        "layer_runs_on": lambda: layer_runs_per_step(model, tokenizer),
        "disable": lambda: call_then_state(model, f"{prefix}_checkpointing_disable"),
        "property_off": lambda: getattr(model, f"is_{prefix}_checkpointing"),
        "layer_runs_off": lambda: layer_runs_per_step(model, tokenizer),
    }
    return {name: attempt(step) for name, step in steps.items()}


def sentence_transformer(encoder_dir: str, major: int):
    """
    A SentenceTransformer whose checkpointing is not one plain Transformer module: on 4.x two Transformer
    modules inside ``Asym`` (query and document encoders), on 6.x a Transformer module plus a custom module whose
    ``gradient_checkpointing_enable`` takes no arguments.
    """
    from sentence_transformers import SentenceTransformer

    if major < 5:
        from sentence_transformers.models import Asym, Pooling, Transformer

        query_encoder, document_encoder = Transformer(encoder_dir), Transformer(encoder_dir)
        encoders = Asym({"query": [query_encoder], "document": [document_encoder]})
        pooling = Pooling(query_encoder.get_word_embedding_dimension())
        return SentenceTransformer(modules=[encoders, pooling], device="cpu")
    model = SentenceTransformer(encoder_dir, device="cpu")
    model.append(no_argument_module())
    return model


def train_two_steps(classifier_dir: str, output_dir: Path) -> dict:
    """
    Train a CrossEncoder for two optimizer steps with ``gradient_checkpointing=True``; return the steps taken,
    whether the model checkpoints afterwards, and the FutureWarnings that mention checkpointing.
    """
    from datasets import Dataset
    from sentence_transformers.cross_encoder import CrossEncoder, CrossEncoderTrainer, CrossEncoderTrainingArguments
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

    model = CrossEncoder(classifier_dir, device="cpu")
    dataset = Dataset.from_dict({"query": SENTENCES[:4], "document": SENTENCES[4:], "label": [1.0, 0.0, 1.0, 0.0]})
    args = CrossEncoderTrainingArguments(
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=2,
        gradient_checkpointing=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
    )
    trainer = CrossEncoderTrainer(model=model, args=args, train_dataset=dataset, loss=BinaryCrossEntropyLoss(model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return {
        "steps": trainer.state.global_step,
        "hf_models": checkpointing_state(model)["hf_models"],
        "warnings": [
            str(warning.message)
            for warning in caught
            if issubclass(warning.category, FutureWarning) and "checkpointing" in str(warning.message)
        ],
    }


def run_checks(work_dir: Path) -> dict:
    """Every check on the sentence_transformers package this interpreter imports."""
    import sentence_transformers
    from sentence_transformers.cross_encoder import CrossEncoder
    from tiny_models import save_tiny_bert
    from transformers import AutoTokenizer, PreTrainedModel

    major = int(sentence_transformers.__version__.split(".")[0])
    classifier_dir = str(save_tiny_bert(work_dir / "classifier", classifier=True))
    encoder_dir = str(save_tiny_bert(work_dir / "encoder"))
    tokenizer = AutoTokenizer.from_pretrained(encoder_dir)
    models = {
        "cross_encoder": CrossEncoder(classifier_dir, device="cpu"),
        "sentence_transformer": sentence_transformer(encoder_dir, major),
    }
    # Names of the checkpointing API, each with the arguments the Trainer of that generation passes.
    apis = {"gradient": {}}
    if major >= 6:
        apis["activation"] = {"every_n_layers": 1, "offload": False}
    observed = {
        "version": sentence_transformers.__version__,
        "module_file": sentence_transformers.__file__,
        "transformers_renamed_checkpointing": hasattr(PreTrainedModel, "activation_checkpointing_enable"),
        "trainer": attempt(lambda: train_two_steps(classifier_dir, work_dir / "trainer")),
    }
    for model_name, model in models.items():
        for prefix, enable_kwargs in apis.items():
            observed[f"{model_name}.{prefix}"] = check_methods(model, tokenizer, prefix, enable_kwargs)
    return observed


def main() -> None:
    """Entry point of the subprocess: print the observations as JSON on the last line of stdout."""
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work_dir:
        observed = run_checks(Path(work_dir))
    print(json.dumps(observed))


# ---------------------------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory) -> Path:
    """The released sources of the installed version with its patches applied."""
    patches = patch_files(PACKAGE, INSTALLED)
    assert patches, f"no patches in patches/{PACKAGE}/{INSTALLED}/"
    return patched_source(PACKAGE, INSTALLED, patches, tmp_path_factory.mktemp("source"))


@pytest.fixture(scope="module")
def runs(patched_tree: Path, tmp_path_factory) -> dict[str, dict]:
    """The observations on the released and on the patched package, both runs side by side."""
    log_root = tmp_path_factory.mktemp("runs")
    sources = {"released": None, "patched": patched_tree}
    processes = {label: start_check_script(__file__, source, log_root / label) for label, source in sources.items()}
    return {label: collect_check_script(process, log_root / label) for label, process in processes.items()}


def result(observed: dict, key: str, step: str):
    """The result of one step, failing with the recorded error if the step raised."""
    outcome = observed[key][step]
    if "error" in outcome:
        pytest.fail(f"{key} {step}: {outcome['error']}")
    return outcome["result"]


def assert_toggles_checkpointing(observed: dict, key: str) -> None:
    """Enable turns checkpointing on in every Hugging Face model and the layers recompute; disable undoes it."""
    enabled = result(observed, key, "enable")["hf_models"]
    assert enabled and all(enabled)
    assert result(observed, key, "property_on") is True
    assert result(observed, key, "layer_runs_on") == 2
    assert not any(result(observed, key, "disable")["hf_models"])
    assert result(observed, key, "property_off") is False
    assert result(observed, key, "layer_runs_off") == 1


def test_each_run_imports_the_intended_package(runs: dict[str, dict], patched_tree: Path) -> None:
    assert runs["released"]["version"] == runs["patched"]["version"] == INSTALLED
    assert Path(runs["patched"]["module_file"]).resolve().is_relative_to(patched_tree.resolve())
    assert not Path(runs["released"]["module_file"]).resolve().is_relative_to(patched_tree.resolve())


@pytest.mark.parametrize("model_name", ["cross_encoder", "sentence_transformer"])
def test_gradient_checkpointing_enable_disable(runs: dict[str, dict], model_name: str) -> None:
    key = f"{model_name}.gradient"
    released = runs["released"][key]
    assert "has no attribute 'is_gradient_checkpointing'" in released["property_on"]["error"]
    assert "has no attribute 'gradient_checkpointing_disable'" in released["disable"]["error"]
    if INSTALLED == "4.1.0":
        assert_toggles_checkpointing(runs["patched"], key)
        return
    # 6.2.0's patch keeps the former name for enabling only: transformers deprecates gradient_checkpointing_disable
    # and is_gradient_checkpointing, so the activation_* names switch checkpointing off and report it.
    patched = runs["patched"][key]
    enabled = result(runs["patched"], key, "enable")["hf_models"]
    assert enabled and all(enabled)
    assert result(runs["patched"], key, "layer_runs_on") == 2
    assert "has no attribute 'is_gradient_checkpointing'" in patched["property_on"]["error"]
    assert "has no attribute 'gradient_checkpointing_disable'" in patched["disable"]["error"]


@pytest.mark.skipif(INSTALLED != "4.1.0", reason="the CrossEncoder methods were added upstream in 5.0.0")
def test_cross_encoder_had_no_checkpointing_methods_on_4x(runs: dict[str, dict]) -> None:
    error = runs["released"]["cross_encoder.gradient"]["enable"]["error"]
    assert error == "AttributeError: 'CrossEncoder' object has no attribute 'gradient_checkpointing_enable'"


@pytest.mark.skipif(INSTALLED != "4.1.0", reason="6.x forwards to every submodule already")
def test_every_transformer_module_is_reached_on_4x(runs: dict[str, dict]) -> None:
    # Both Transformer modules sit inside Asym, which upstream's top-level loop never looks into.
    assert result(runs["released"], "sentence_transformer.gradient", "enable")["hf_models"] == [False, False]
    assert result(runs["patched"], "sentence_transformer.gradient", "enable")["hf_models"] == [True, True]


def test_cross_encoder_trainer_with_gradient_checkpointing(runs: dict[str, dict]) -> None:
    trained = runs["patched"]["trainer"]
    assert "error" not in trained, trained.get("error")
    assert trained["result"]["steps"] == 2
    assert all(trained["result"]["hf_models"])
    assert trained["result"]["warnings"] == []

    released = runs["released"]["trainer"]
    if INSTALLED == "4.1.0":
        assert released["error"] == (
            "AttributeError: 'CrossEncoder' object has no attribute 'gradient_checkpointing_enable'"
        )
    else:
        assert released["result"]["steps"] == 2
        if runs["released"]["transformers_renamed_checkpointing"]:
            # The Trainer falls back to the name it deprecated, and warns.
            warned = released["result"]["warnings"]
            assert any("only defines `gradient_checkpointing_enable`" in text for text in warned)


@pytest.mark.skipif(INSTALLED != "6.2.0", reason="transformers 4.x has no activation checkpointing names")
@pytest.mark.parametrize("model_name", ["cross_encoder", "sentence_transformer"])
def test_activation_checkpointing_enable_disable(runs: dict[str, dict], model_name: str) -> None:
    key = f"{model_name}.activation"
    assert_toggles_checkpointing(runs["patched"], key)
    assert "has no attribute 'activation_checkpointing_enable'" in runs["released"][key]["enable"]["error"]


@pytest.mark.skipif(INSTALLED != "6.2.0", reason="the custom module check targets the 6.x module tree")
def test_module_whose_enable_takes_no_arguments(runs: dict[str, dict]) -> None:
    released = runs["released"]["sentence_transformer.gradient"]["enable"]["error"]
    assert "gradient_checkpointing_enable() takes 1 positional argument but 2 were given" in released
    # Called once through the old name, once through the new one with the Trainer's options.
    assert result(runs["patched"], "sentence_transformer.gradient", "enable")["custom_enable_calls"] == [1]
    assert result(runs["patched"], "sentence_transformer.activation", "enable")["custom_enable_calls"] == [2]


if __name__ == "__main__":
    main()
