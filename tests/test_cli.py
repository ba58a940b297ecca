"""The st-ext command: a full tiny run, its files, and one clear line for each bad input."""

from __future__ import annotations

import csv
import json
import os
import re
import typing

import pytest
import torch
from tiny_models import SENTENCES

from st_ext import SentenceTransformerTrainingArguments
from st_ext.cli import EXIT_BAD_INPUT, main

#: How a config error describes ``gradient_checkpointing``: transformers 5 declares it ``bool | None``.
CHECKPOINTING_EXPECTS = (
    "true or false or nothing"
    if type(None)
    in typing.get_args(typing.get_type_hints(SentenceTransformerTrainingArguments)["gradient_checkpointing"])
    else "true or false"
)


@pytest.fixture
def pairs_file(tmp_path):
    rows = [
        {"question": f"{s} {i}", "answer": f"{SENTENCES[(i + 3) % len(SENTENCES)]} {i}"}
        for i, s in enumerate(SENTENCES * 3)
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def tiny_run_args(model_dir, data, output_dir, *extra, anchor="question", positive="answer"):
    """``st-ext train`` on a tiny model for two steps of four pairs, over ``data``'s ``anchor`` and ``positive`` columns."""
    return [
        "train",
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--anchor-column",
        anchor,
        "--positive-column",
        positive,
        "--max-steps",
        "2",
        "--batch-size",
        "4",
        "--mini-batch-size",
        "2",
        "--matryoshka-dims",
        "32",
        "16",
        "--output-dir",
        str(output_dir),
        *extra,
    ]


def test_tiny_run_writes_model_reports_and_plots(tiny_bert_dir, pairs_file, tmp_path, capsys):
    output = tmp_path / "run"
    previous_umask = os.umask(0o022)
    try:
        assert main(tiny_run_args(tiny_bert_dir, pairs_file, output, "--loss", "matryoshka_cached_mnrl")) == 0
    finally:
        os.umask(previous_umask)
    written = [
        output / "model",
        output / "model" / "modules.json",
        output / "metrics.json",
        output / "ndcg_by_dim.png",
    ]
    assert [oct(path.stat().st_mode & 0o777) for path in written] == ["0o755", "0o644", "0o644", "0o644"], (
        "the user's umask"
    )
    printed = capsys.readouterr().out
    assert "recall@10" in printed and str(output / "ndcg_by_dim.png") in printed
    phases = [
        "evaluating the starting model",
        "\ntraining: 2 steps",
        "evaluating the trained model",
        "saving the model",
    ]
    assert sorted(phases, key=printed.index) == phases, "each phase says so as it starts, in order"
    # Each logged loss is the sum over the two dimensions; loss_per_dim, logged beside it, is their mean.
    logged = [line for line in printed.splitlines() if "'loss':" in line]
    assert len(logged) == 2
    for line in logged:
        figures = {name: float(value) for name, value in re.findall(r"'(loss|loss_per_dim)': '?([-\d.e+]+)", line)}
        assert figures["loss_per_dim"] == pytest.approx(figures["loss"] / 2, rel=2e-3)  # both printed to 4 digits
    assert "loss_per_dim is that sum divided by 2 (their mean)" in printed, "the log says what the figure is"
    assert "not the loss at any one dimension" in printed
    metrics = json.loads((output / "metrics.json").read_text())
    assert set(metrics["before"]) == set(metrics["after"]) == {"32", "16"}
    rows = list(csv.DictReader((output / "memory_per_step.csv").open()))
    assert [row["step"] for row in rows] == ["1", "2"]
    assert all(float(row["peak_mib"]) > 0 for row in rows)
    for png in ("memory_per_step.png", "ndcg_by_dim.png"):
        assert (output / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (output / "model" / "modules.json").is_file()
    assert not [p.name for p in output.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_config_file_with_precomputed_guide(tiny_bert_dir, pairs_file, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(
        f"model: {tiny_bert_dir}\ndata: {pairs_file}\nanchor_column: question\npositive_column: answer\n"
        f"loss: matryoshka_cached_gist\nguide_mode: precompute\nmax_steps: 2\nbatch_size: 4\n"
        f"mini_batch_size: 2\nmatryoshka_dims: [32, 8]\noutput_dir: {tmp_path / 'run'}\n"
    )
    assert main(["train", "--config", str(config)]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert set(metrics["after"]) == {"32", "8"}
    # The guide's release report (malloc_trim, RSS) is in metrics.json; the console shows it with --verbose only.
    released = metrics["memory"]["frozen_encoders"]
    assert released["mode"] == "precompute" and released["release_reports"][0].startswith("Released ")
    assert "malloc_trim" in released["release_reports"][0]
    printed = capsys.readouterr()
    assert "malloc_trim" not in printed.out + printed.err and "Released " not in printed.out
    assert "Loading weights" not in printed.err and "Generating train split" not in printed.err


def test_non_cached_gist_with_offloaded_guide(tiny_bert_dir, pairs_file, tmp_path):
    output = tmp_path / "run"
    args = tiny_run_args(tiny_bert_dir, pairs_file, output, "--loss", "matryoshka_gist", "--guide-mode", "offload")
    del args[args.index("--mini-batch-size") : args.index("--mini-batch-size") + 2]  # a non-cached loss has none
    assert main(args) == 0
    assert set(json.loads((output / "metrics.json").read_text())["after"]) == {"32", "16"}


def test_auto_mini_batch_size_is_measured_and_reported(tiny_bert_dir, pairs_file, tmp_path, capsys):
    args = tiny_run_args(tiny_bert_dir, pairs_file, tmp_path / "run", "--loss", "cached_mnrl")
    args[args.index("--mini-batch-size") + 1] = "auto"
    assert main(args + ["--memory-budget-mb", "4096", "--matryoshka-dims", "32"]) == 0
    assert "mini_batch_size auto -> 8 (one pass over all 8 texts in 2 columns" in capsys.readouterr().out


@pytest.fixture
def built_losses(monkeypatch) -> list:
    """The losses ``st-ext train`` builds, in order."""
    from st_ext.cli import job

    built = []
    real_build = job.build_loss

    def recording_build(*args, **kwargs):
        built.append(real_build(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(job, "build_loss", recording_build)
    return built


def test_kept_graphs_reach_the_cached_loss(tiny_bert_dir, pairs_file, tmp_path, built_losses):
    """--kept-graphs reaches the cached loss (tests/test_partial_caching.py shows what it does) and metrics.json."""
    args = tiny_run_args(tiny_bert_dir, pairs_file, tmp_path / "run", "--loss", "cached_mnrl", "--kept-graphs", "1")
    args[args.index("--mini-batch-size") + 1] = "2"
    assert main(args + ["--matryoshka-dims", "32"]) == 0
    (loss,) = built_losses
    assert loss.kept_graphs == 1
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["settings"]["kept_graphs"] == 1


def test_self_guided_gist_trains_with_the_model_as_its_guide(tiny_bert_dir, pairs_file, tmp_path, built_losses):
    args = tiny_run_args(tiny_bert_dir, pairs_file, tmp_path / "run", "--self-guided")
    assert main(args) == 0
    (loss,) = built_losses  # MatryoshkaLoss over CachedGISTEmbedLoss
    assert loss.loss.guides_itself
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["settings"]["self_guided"] is True and metrics["memory"]["frozen_encoders"]["mode"] == "resident"


@pytest.mark.parametrize(
    "change, message",
    [
        (["--model", "/no/such/model"], "model: '/no/such/model' is not a directory"),
        (["--loss", "no_such_loss"], "unknown name 'no_such_loss'"),
        (["--anchor-column", "query"], "column(s) query not in pairs.jsonl"),
        (["--matryoshka-dims", "64"], "exceed the model's embedding size 32"),
        (["--mini-batch-size", "auto", "--memory-budget-mb", "-5"], "memory_budget_mb: -5.0 must be positive"),
        (["--data", "/no/such/file.jsonl"], "does not exist"),
        (["--guide-mode", "sideways"], "guide_mode: 'sideways' is not one of resident, offload, precompute"),
        (["--max-pairs", "-5"], "max_pairs: -5 is out of range; use 0 (all pairs) or more"),
        (["--epochs", "-1"], "epochs: -1.0 is out of range; use a number above 0"),
        (["--max-steps", "0"], "max_steps: 0 is out of range; use -1 (train by epochs) or a positive number"),
        (["--max-seq-length", "0"], "max_seq_length: 0 is out of range; use 1 or more tokens"),
        (["--max-seq-length", "100000"], "max_seq_length: 100000 is above the"),
        (["--learning-rate", "-0.001"], "learning_rate: -0.001 is out of range; use a number above 0"),
        (["--seed", "-1"], "seed: -1 is out of range; use 0 or more"),
        (["--output-dir", "__FILE__/run"], "is a file, not a directory; pass a directory for the results"),
        (["--data", "__TMP__"], "is a directory; pass a JSONL, CSV or Parquet file"),
        (["--model", "__TMP__"], "holds no model (none of modules.json, config.json)"),
        (
            ["--loss", "cosent"],
            "'cosent' trains on (sentence_A, sentence_B, score) rows, but st-ext train gives (anchor, positive) rows",
        ),
        (["--loss", "batch_all_triplet"], "'batch_all_triplet' trains on (text, label) rows"),
        (
            ["--loss", "cached_mnrl", "--guide", "__TMP__"],
            "guide: 'cached_mnrl' would ignore it (only the GIST losses use a guide)",
        ),
        (["--loss", "mnrl"], "mini_batch_size: 'mnrl' would ignore it (only the cached losses split batches"),
        (
            ["--memory-budget-mb", "100"],
            "memory_budget_mb: 'matryoshka_cached_gist' would ignore it (it sizes mini_batch_size auto",
        ),
        (["--kept-graphs", "-1"], "kept_graphs: -1 must be 0 or more mini-batches"),
        (
            ["--self-guided", "true", "--guide-mode", "offload"],
            "self_guided: the model being trained is the guide, so there is no other guide to load",
        ),
        (["--self-guided", "true", "--guide", "__TMP__"], "leave out guide and guide_mode"),
        (["--loss", "cached_mnrl", "--self-guided", "true"], "self_guided: 'cached_mnrl' would ignore it"),
        (
            ["--mini-batch-size", "auto", "--kept-graphs", "1"],
            "kept_graphs: --kept-graphs and --mini-batch-size auto do not go together (auto chooses how many graphs "
            "to keep from the memory it measures); leave out --kept-graphs, or give --mini-batch-size a number.",
        ),
        (["--mini-batch-size", "auto", "--kept-graphs", "0"], "--kept-graphs and --mini-batch-size auto do not go"),
        (["--loss", "mnrl", "--mini-batch-size", "8", "--kept-graphs", "1"], "'mnrl' would ignore it"),
        # The library's message names the Python arguments; the command adds their flags.
        (
            ["--mini-batch-size", "auto", "--memory-budget-mb", "0.01"],
            "Raise memory_budget_mb, or choose a lighter optimizer (the training arguments' optim, e.g. 'adafactor'). (flags: --mini-batch-size, --memory-budget-mb, --optim)",
        ),
    ],
)
def test_bad_input_is_one_clear_line(tiny_bert_dir, pairs_file, tmp_path, capsys, change, message):
    args = tiny_run_args(tiny_bert_dir, pairs_file, tmp_path / "run")
    change = [value.replace("__FILE__", str(pairs_file)).replace("__TMP__", str(tmp_path)) for value in change]
    for flag, value in zip(change[::2], change[1::2]):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    assert main(args) == EXIT_BAD_INPUT
    stderr = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in stderr if "error" in line.lower()]
    assert errors == [stderr[-1]] and errors[0].startswith("st-ext train: error: ") and message in errors[0]
    assert not (tmp_path / "run" / "model").exists()


@pytest.mark.parametrize(
    "content, message",
    [
        ("batch_size: [unclosed", "is not valid YAML"),
        ("- a\n- b\n", "must hold a mapping"),
        ("batch_sise: 3\n", "unknown setting(s) batch_sise"),
        ("batch_size: eight\n", "config: batch_size: expected an integer, got 'eight'."),
        ("batch_size:\n", "config: batch_size: expected an integer, got None."),
        ("batch_size: 2.5\n", "config: batch_size: expected an integer, got 2.5."),
        (
            "matryoshka_dims: 32\n",
            "config: matryoshka_dims: expected a list (an integer each), e.g. [384, 128], got 32.",
        ),
        ("matryoshka_dims: [32, x]\n", "config: matryoshka_dims: expected an integer, got 'x'."),
        (
            "gradient_checkpointing: maybe\n",
            f"config: gradient_checkpointing: expected {CHECKPOINTING_EXPECTS}, got 'maybe'.",
        ),
        ("model: [a, b]\n", "config: model: expected text or nothing, got ['a', 'b']."),
        ("memory_budget_mb: lots\n", "config: memory_budget_mb: expected a number or nothing, got 'lots'."),
    ],
)
def test_malformed_config_is_refused(tmp_path, capsys, content, message):
    config = tmp_path / "config.yaml"
    config.write_text(content)
    assert main(["train", "--config", str(config)]) == EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


def test_config_values_are_converted_as_flags_would_be(tiny_bert_dir, pairs_file, tmp_path):
    """YAML 1.1 reads ``1e-4`` as text and ``5`` as a number: each becomes what its flag would."""
    from st_ext.cli.arguments import load_config_file

    config = tmp_path / "config.yaml"
    config.write_text(
        "learning_rate: 1e-4\nmodel: 5\nbatch_size: '8'\nmini_batch_size: auto\ngradient_checkpointing: yes\n"
    )
    assert load_config_file(config) == {
        "learning_rate": 1e-4,
        "model": "5",
        "per_device_train_batch_size": 8,
        "mini_batch_size": "auto",
        "gradient_checkpointing": True,
    }


def test_flags_win_over_the_config_file(tiny_bert_dir, pairs_file, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"loss": "no_such_loss", "batch-size": 4, "anchor_column": "question"}))
    args = ["train", "--config", str(config), "--loss", "cached_mnrl", "--batch-size", "1"]
    args += ["--model", str(tiny_bert_dir), "--data", str(pairs_file), "--output-dir", str(tmp_path / "run")]
    # The flag's loss replaced the file's unknown one, and the flag's batch size is the one refused.
    assert main(args) == EXIT_BAD_INPUT
    assert "batch_size: 1 leaves no in-batch negatives" in capsys.readouterr().err


def test_help_lists_every_setting_with_its_default(capsys):
    from st_ext.cli.job import TrainConfig

    with pytest.raises(SystemExit) as stop:
        main(["train", "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name in TrainConfig.field_names():
        assert "--" + name.replace("_", "-") in text
    for default in ("(default: 32)", "(default: 8)", "(default: [384, 256, 128, 64, 32])", "(default: precompute)"):
        assert default in text
    assert "--batch-size PER_DEVICE_TRAIN_BATCH_SIZE short for" in text
    assert "--epochs NUM_TRAIN_EPOCHS short for" in text, "a one-word alias is listed once"
    flags = re.findall(r"(?<![\w-])--[a-z][\w-]*", text)
    assert not [flag for flag in flags if "_" in flag], "one spelling per flag: the docs' --anchor-column"
    assert "--warmup-ratio" not in text and "--help-trainer" in text, "the Trainer's arguments are behind a flag"


def test_help_trainer_adds_the_trainers_arguments(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--help-trainer"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert "--warmup-ratio WARMUP_RATIO" in text and "--anchor-column" in text
    assert "--warmup_ratio" not in text


def listed_losses(capsys) -> dict[str, str]:
    """``--list-losses``: each loss's line by name, after the line that explains the mark."""
    assert main(["train", "--list-losses"]) == 0
    legend, *rows = capsys.readouterr().out.splitlines()
    assert legend.startswith("* = st-ext train trains it")
    return {row[2:].split()[0]: row for row in rows}


def test_list_losses_says_what_each_trains_on(capsys):
    from st_ext.losses.registry import known_losses

    lines = listed_losses(capsys)
    assert sorted(lines) == known_losses()
    assert "(anchor, positive[, negative_1, ...])" in lines["matryoshka_cached_gist"]
    assert "(sentence_A, sentence_B, score)" in lines["cosent"] and "(text, label)" in lines["xbm_batch_hard_triplet"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unwritable_output_dir_is_refused_before_training(tiny_bert_dir, pairs_file, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert main(tiny_run_args(tiny_bert_dir, pairs_file, locked / "run")) == EXIT_BAD_INPUT
    assert "is not writable" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.jsonl", b"", "empty.jsonl is empty."),
        ("bad.jsonl", b'{"anchor": "a", "positive": "b"}\n{"anchor": "a",\n', "bad.jsonl line 2 is not valid JSON"),
        ("latin1.csv", "anchor,positive\ncaf\u00e9,b\n".encode("latin-1"), "latin1.csv line 2 is not UTF-8 (byte 4)"),
        ("lists.jsonl", b'{"anchor": ["a", "b"], "positive": "c"}\n', "lists.jsonl row 1: column 'anchor' holds list"),
        ("objects.jsonl", b'{"anchor": "a", "positive": {"text": "c"}}\n', "column 'positive' holds dict"),
    ],
)
def test_unreadable_data_is_one_line_with_its_place(tiny_bert_dir, tmp_path, capsys, name, content, message):
    data = tmp_path / name
    data.write_bytes(content)
    args = ["train", "--model", str(tiny_bert_dir), "--data", str(data), "--output-dir", str(tmp_path / "run")]
    args += ["--matryoshka-dims", "32"]  # the tiny model's size: the settings are checked before the data's content
    assert main(args) == EXIT_BAD_INPUT
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], errors


def test_every_error_has_the_same_form(capsys):
    """argparse's own errors and st_ext's start alike."""
    with pytest.raises(SystemExit) as stop:
        main(["train", "--batch-size", "many"])
    assert stop.value.code == EXIT_BAD_INPUT
    argparse_error = capsys.readouterr().err.strip().splitlines()[-1]
    assert main(["train", "--config", "/"]) == EXIT_BAD_INPUT
    own_error = capsys.readouterr().err.strip()
    assert argparse_error.startswith("st-ext train: error: ") and own_error.startswith("st-ext train: error: ")
    assert own_error == "st-ext train: error: config: / is a directory; pass a YAML or JSON file."


def test_an_interrupt_is_one_line_saying_where_the_results_are(
    tiny_bert_dir, pairs_file, tmp_path, monkeypatch, capsys
):
    from st_ext.cli import job

    def interrupted(config, trainer_settings, **options):
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "run", interrupted)
    assert main(tiny_run_args(tiny_bert_dir, pairs_file, tmp_path / "run")) == 130
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"st-ext train: interrupted; nothing was written to {tmp_path / 'run'}: it holds the previous run's results, if any."
    )


def test_max_pairs_caps_only_the_built_in_pairs(tmp_path):
    from st_ext.cli.data import Columns, training_rows

    rows = [{"anchor": f"question {i}", "positive": f"answer {i}"} for i in range(1000)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in rows))
    assert len(training_rows(str(data), Columns(), None).rows) == 1000
    assert len(training_rows(str(data), Columns(), 300).rows) == 300
    assert len(training_rows(None, Columns(), None).rows) == 600
    assert len(training_rows(None, Columns(), 0).rows) > 600


def test_empty_data_is_refused(tiny_bert_dir, tmp_path, capsys):
    empty = tmp_path / "empty.csv"
    empty.write_text("anchor,positive\n")
    args = [
        "train",
        "--model",
        str(tiny_bert_dir),
        "--data",
        str(empty),
        "--output-dir",
        str(tmp_path / "run"),
        "--matryoshka-dims",
        "32",
    ]
    assert main(args) == EXIT_BAD_INPUT
    assert capsys.readouterr().err.strip() == (
        f"st-ext train: error: data: {empty} has a header line and no rows; add rows below the header."
    )


def test_every_loss_listed_as_trainable_is_accepted_and_every_other_refused(tiny_bert_dir, tmp_path, capsys):
    """The mark of ``--list-losses`` is what the command's validation does, loss by loss."""
    from st_ext.cli.arguments import parse_train_args
    from st_ext.cli.job import ConfigError, TrainConfig, validate

    lines = listed_losses(capsys)
    trainable = [name for name, line in lines.items() if line.startswith("* ")]
    assert 0 < len(trainable) < len(lines)
    _, _, settings = parse_train_args(["--output-dir", str(tmp_path / "run")])
    for name, line in lines.items():
        negatives = ["neg"] if "(needs one --negative-columns)" in line else []
        config = TrainConfig(model=str(tiny_bert_dir), loss=name, negative_columns=negatives, matryoshka_dims=[32])
        if name in trainable:
            validate(config, settings)
        else:
            with pytest.raises(ConfigError, match=f"loss: '{name}' trains on .* rows, but st-ext train gives"):
                validate(config, settings)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "many"], "argument --batch-size/--batch_size: invalid int value: 'many'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        # Abbreviations are refused, not expanded to whichever flag they start.
        (["--anchor_colum", "question"], "unrecognized arguments: --anchor_colum question"),
        (["--anchor-col", "question"], "unrecognized arguments: --anchor-col question"),
        (["--list-loss"], "unrecognized arguments: --list-loss"),
    ],
)
def test_a_flag_mistake_is_one_line_without_the_usage_block(capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        main(["train", *argv])
    assert stop.value.code == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"st-ext train: error: {message} (`st-ext train --help` lists every setting)"]


def test_every_parser_refuses_abbreviations():
    from st_ext.cli.arguments import build_train_parser
    from st_ext.cli.main import build_parser

    train_parser = build_train_parser()
    assert train_parser.allow_abbrev is False and build_parser().allow_abbrev is False
    assert train_parser.parse_args(["--anchor_column", "q", "--anchor-column", "question"]).anchor_column == "question"


def test_matryoshka_dims_above_the_model_size_fail_before_anything_loads(tmp_path, capsys, monkeypatch):
    """The packaged model declares 384 in its files: 512 is refused before the model or the data loads."""
    from st_ext.cli import job

    def not_now(*args, **kwargs):
        raise AssertionError("loaded before the settings were checked")

    monkeypatch.setattr(job, "SentenceTransformer", not_now)
    monkeypatch.setattr(job, "_datasets", not_now)
    assert main(["train", "--matryoshka-dims", "512", "256", "--output-dir", str(tmp_path / "run")]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "st-ext train: error: matryoshka_dims: [512] exceed the model's embedding size 384; use 384 or less."
    ]


def test_a_model_whose_files_do_not_declare_its_size_is_checked_right_after_loading(
    tiny_bert_dir, pairs_file, tmp_path, capsys, monkeypatch
):
    from st_ext.cli import job

    def not_now(*args, **kwargs):
        raise AssertionError("evaluated before the dimensions were checked")

    monkeypatch.setattr(job, "declared_dimension", lambda name: None)
    monkeypatch.setattr(job, "evaluate", not_now)
    args = tiny_run_args(tiny_bert_dir, pairs_file, tmp_path / "run")
    args[args.index("--matryoshka-dims") + 1 : args.index("--matryoshka-dims") + 3] = ["64", "16"]
    assert main(args) == EXIT_BAD_INPUT
    errors = capsys.readouterr().err.strip().splitlines()
    assert (
        errors[-1]
        == "st-ext train: error: matryoshka_dims: [64] exceed the model's embedding size 32; use 32 or less."
    )


def test_the_size_a_saved_model_declares_is_the_size_it_loads_with(tiny_bert_dir, tmp_path):
    """The files are read without loading, so the reading must agree with sentence-transformers."""
    from st_ext import SentenceTransformer
    from st_ext._compat import embedding_dimension, st_modules
    from st_ext.cli.job import declared_dimension, packaged_model_path

    modules = st_modules()
    folders = {"plain transformers model": tiny_bert_dir, "packaged": packaged_model_path()}
    two_modes = modules.Pooling(
        32, pooling_mode_cls_token=True, pooling_mode_max_tokens=True, pooling_mode_mean_tokens=False
    )
    stacks = {
        "mean pooling": [modules.Pooling(32)],
        "two pooling modes": [two_modes],
        "dense and normalize": [
            modules.Pooling(32),
            modules.Dense(in_features=32, out_features=16),
            modules.Normalize(),
        ],
    }
    for label, rest in stacks.items():
        model = SentenceTransformer(modules=[modules.Transformer(str(tiny_bert_dir)), *rest], device="cpu")
        model.save(str(tmp_path / label))
        folders[label] = tmp_path / label
    for label, folder in folders.items():
        loaded = embedding_dimension(SentenceTransformer(str(folder), device="cpu"))
        assert declared_dimension(str(folder)) == loaded, label
    assert {
        declared_dimension(str(folders["two pooling modes"])),
        declared_dimension(str(folders["dense and normalize"])),
    } == {64, 16}
    assert declared_dimension("sentence-transformers/all-MiniLM-L6-v2") is None, "a Hub id: checked once loaded"


def test_an_unreadable_data_file_is_one_line_before_anything_loads(
    tiny_bert_dir, pairs_file, tmp_path, capsys, monkeypatch
):
    """Mode 000; where the tests run as root (which reads it anyway), ``open`` in st_ext.cli.data is made
    to fail as it would for another user."""
    from st_ext.cli import data, job

    pairs_file.chmod(0o000)
    if os.geteuid() == 0:

        def refused(path, *args, **kwargs):
            raise PermissionError(13, "Permission denied", str(path))

        monkeypatch.setattr(data, "open", refused, raising=False)
    monkeypatch.setattr(job, "SentenceTransformer", None)  # loading would fail with a TypeError traceback
    try:
        assert main(tiny_run_args(tiny_bert_dir, pairs_file, tmp_path / "run")) == EXIT_BAD_INPUT
    finally:
        pairs_file.chmod(0o644)
    assert capsys.readouterr().err.splitlines() == [
        f"st-ext train: error: data: cannot read {pairs_file} (Permission denied); check its permissions."
    ]


def test_an_interrupted_step_leaves_no_profiler_running():
    """Ctrl-C inside a step: the job stops the step's measurement, or the CPU profiler warns at exit."""
    from types import SimpleNamespace

    from st_ext.cli.reporting import StepMemoryRecorder

    recorder = StepMemoryRecorder("cpu")
    recorder.on_step_begin(None, SimpleNamespace(global_step=0), None)
    assert torch.autograd.profiler._is_profiler_enabled
    recorder.stop()
    assert not torch.autograd.profiler._is_profiler_enabled and recorder.rows == []
    recorder.stop()  # nothing open: nothing to do


def test_library_errors_name_python_arguments_not_flags():
    """Errors raised outside st_ext.cli are read by Python users: they name ``optim=``, not ``--optim``;
    the command adds its flags (see the memory_budget_mb case above)."""
    import ast
    import re
    from pathlib import Path

    import st_ext

    package = Path(st_ext.__file__).parent
    flagged = []
    for source in sorted(package.rglob("*.py")):
        if "cli" in source.relative_to(package).parts:
            continue
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            is_warning = isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "warn",
                "warning",
            )
            if isinstance(node, ast.Raise) or is_warning:
                for part in ast.walk(node):
                    if (
                        isinstance(part, ast.Constant)
                        and isinstance(part.value, str)
                        and re.search(r"(?<![\w-])--[a-z]", part.value)
                    ):
                        flagged.append(f"{source.relative_to(package)}:{part.lineno}: {part.value}")
    assert flagged == []


def test_the_uncached_reference_is_the_trained_loss_without_caching(model, guide):
    """For every loss the command trains, the plot's dashed line is the same loss family without GradCache
    (the same wrappers, the same guide), never a stand-in such as MNRL for GIST."""
    from st_ext.cli.reference_peak import build_reference_loss, uncached_counterpart
    from st_ext.losses.registry import MATRYOSHKA_PREFIX, build_loss, known_losses, loss_spec

    wrappers = ("MatryoshkaLoss", "CrossBatchMemoryLoss")

    def chain(loss):
        """The loss's classes from the outermost wrapper to the loss over embeddings."""
        names = [type(loss).__name__]
        while names[-1] in wrappers:
            loss = loss.loss
            names.append(type(loss).__name__)
        return names

    compared = []
    for name in known_losses():
        spec = loss_spec(name)
        if not (spec.trains_on(0) or spec.trains_on(1)):
            continue
        if not spec.cached:
            assert uncached_counterpart(name) is None, name
            continue
        kwargs = {"mini_batch_size": 2, **({"guide": guide} if spec.guided else {})}
        dims = [32, 16]
        trained = build_loss(
            name, model, **kwargs, **({"matryoshka_dims": dims} if name.startswith(MATRYOSHKA_PREFIX) else {})
        )
        reference = build_reference_loss(name, trained, model, dims)
        expected = [class_name.removeprefix("Cached") for class_name in chain(trained)]
        if name == "matryoshka_xbm_cached_mnrl":
            # The registry has no Matryoshka over an uncached queue; the queue holds no graph.
            expected.remove("CrossBatchMemoryLoss")
        assert chain(reference) == expected, name
        assert (
            not loss_spec(uncached_counterpart(name)).cached
            and loss_spec(uncached_counterpart(name)).guided == spec.guided
        )
        if spec.guided:
            inner = reference.loss if name.startswith(MATRYOSHKA_PREFIX) else reference
            assert inner.guide is guide, "the trained loss's guide"
        compared.append(name)
    assert {
        "matryoshka_cached_gist",
        "cached_gist",
        "cached_mnrl",
        "matryoshka_cached_mnsrl",
        "xbm_cached_mnrl",
    } <= set(compared)


#: How far the reference may be below the trained figure where caching cannot help (same batch, same
#: forward and backward): the trained step also clips the gradients (a few scalars). The reference may be
#: above it: upstream's Matryoshka over an uncached loss keeps every dimension's truncated copies.
LIKE_FOR_LIKE_MARGIN = 0.02


@pytest.mark.parametrize(
    "loss, reference_loss",
    [("matryoshka_cached_mnrl", "matryoshka_mnrl"), ("matryoshka_cached_gist", "matryoshka_gist")],
)
def test_where_caching_cannot_help_the_plot_compares_equal_figures(
    tiny_bert6_dir, pairs_file, tmp_path, monkeypatch, loss, reference_loss
):
    """One mini-batch holds the whole batch, so the cached loss does what the uncached one does: the
    reference is not below the trained figure (neither counts the optimizer's first-step state, which on
    this model and these short texts outweighs the activations), and the plot says what it counts and
    which loss the dashed line is."""
    from st_ext.cli import reporting
    from st_ext.cli.reference_peak import FORWARD_BACKWARD_SHORT

    figures = []
    save = reporting._save
    monkeypatch.setattr(reporting, "_save", lambda figure, path: figures.append(figure) or save(figure, path))
    args = tiny_run_args(tiny_bert6_dir, pairs_file, tmp_path / "run", "--loss", loss)
    args[args.index("--mini-batch-size") + 1] = "4"  # the batch size
    args[args.index("--max-steps") + 1] = "1"
    assert main(args) == 0
    memory = json.loads((tmp_path / "run" / "metrics.json").read_text())["memory"]
    reference = memory["uncached_reference"]
    trained, uncached = reference["trained_loss_same_batch_mib"], reference["peak_mib"]
    assert reference["loss"] == reference_loss and reference["counts"] == memory["forward_backward_counts"]
    assert uncached >= (1 - LIKE_FOR_LIKE_MARGIN) * trained > 0, (trained, uncached)
    assert memory["forward_backward_peak_mib"] == trained
    assert memory["step_peak_mib"] > uncached, "the whole step, AdamW's state included: not what the plot compares"

    [axes] = next(figure for figure in figures if "Peak memory" in figure.axes[0].get_title()).axes
    assert FORWARD_BACKWARD_SHORT in axes.get_title() and "forward+backward" in axes.get_ylabel()
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert legend[0].startswith(f"{loss} (trained, cached)")
    assert legend[1].startswith(f"{reference_loss}: {loss} without caching, on the first step's batch of 4: ")
