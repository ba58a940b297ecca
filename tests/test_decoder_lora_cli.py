"""``st-ext train --lora-rank``: a tiny decoder embedder trains a LoRA adapter (its base weights untouched),
saved as peft writes it; bad LoRA settings and a missing peft are one line each."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from test_cli import tiny_run_args
from tiny_decoders import decoder_embedder, save_tiny_decoder
from tiny_models import SENTENCES

from st_ext.cli import EXIT_BAD_INPUT, main

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def decoder_model_dir(tmp_path_factory):
    """A saved sentence-transformers decoder embedder (last-token pooling, left padding, query prompt)."""
    root = tmp_path_factory.mktemp("cli_decoder")
    model = decoder_embedder(save_tiny_decoder(root / "hf", "qwen3"))
    model.save(str(root / "st"))
    return root / "st"


@pytest.fixture
def pairs_file(tmp_path):
    rows = [
        {"question": f"{s} {i}", "answer": SENTENCES[(i + 3) % len(SENTENCES)]} for i, s in enumerate(SENTENCES * 2)
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    return path


def lora_run_args(model_dir, data, output_dir, *extra):
    """``st-ext train`` of test_cli's tiny run (two steps of four pairs), on cached Matryoshka MNRL."""
    return tiny_run_args(
        model_dir, data, output_dir, "--loss", "matryoshka_cached_mnrl", "--learning-rate", "0.01", *extra
    )


def test_lora_run_trains_and_saves_only_the_adapter(decoder_model_dir, pairs_file, tmp_path, capsys):
    from safetensors.torch import load_file

    from st_ext import SentenceTransformer

    output = tmp_path / "run"
    argv = lora_run_args(decoder_model_dir, pairs_file, output, "--lora-rank", "4", "--lora-target-modules", "q_proj")
    assert main(argv) == 0
    assert "LoRA adapter of rank 4:" in capsys.readouterr().out
    saved = output / "model"
    config = json.loads((saved / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8, ["q_proj"])
    weights = load_file(saved / "adapter_model.safetensors")
    assert weights and all("lora_" in key for key in weights)
    assert any("lora_B" in key and value.abs().sum() > 0 for key, value in weights.items()), "the adapter trained"
    base = SentenceTransformer(str(decoder_model_dir), device="cpu")
    trained = SentenceTransformer(str(saved), device="cpu")
    base_weights = {name.split("base_layer.")[-1]: p for name, p in base[0].auto_model.named_parameters()}
    for name, param in trained[0].auto_model.named_parameters():
        if "lora_" not in name:
            key = name.replace("base_model.model.", "").replace("base_layer.", "")
            torch.testing.assert_close(param, base_weights[key], rtol=0, atol=0, msg=name)
    texts = ["the cat is in the house"]
    assert not torch.allclose(
        trained.encode(texts, convert_to_tensor=True), base.encode(texts, convert_to_tensor=True)
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--lora-rank", "0"], "lora_rank: 0 must be a positive integer"),
        (["--lora-rank", "4", "--lora-alpha", "-1"], "lora_alpha: -1.0 must be a number above 0"),
        (["--lora-rank", "4", "--lora-dropout", "1"], "lora_dropout: 1.0 must be at least 0 and below 1"),
        (["--lora-alpha", "8"], "lora_alpha: only a LoRA adapter uses it; set lora_rank too"),
        (
            ["--lora-rank", "4", "--lora-target-modules", "no_such_proj"],
            "lora_target_modules: no_such_proj names no layer of the model; its linear layers are",
        ),
    ],
)
def test_bad_lora_settings_are_one_line(decoder_model_dir, pairs_file, tmp_path, capsys, extra, message):
    assert main(lora_run_args(decoder_model_dir, pairs_file, tmp_path / "run", *extra)) == EXIT_BAD_INPUT
    stderr = capsys.readouterr().err.strip().splitlines()
    assert len(stderr) == 1 and message in stderr[0], stderr


def test_missing_peft_is_one_line_before_anything_loads(decoder_model_dir, pairs_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    assert main(lora_run_args(decoder_model_dir, pairs_file, tmp_path / "run", "--lora-rank", "4")) == EXIT_BAD_INPUT
    stderr = capsys.readouterr().err.strip().splitlines()
    assert len(stderr) == 1 and "lora_rank: LoRA needs the peft package: pip install 'st-ext[peft]'" in stderr[0]
