"""st-ext train as a practitioner's tool: the Trainer's own arguments, checkpoints and resume, hard
negatives, an eval file, Hub names offline, what metrics.json reports, and the console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cli import tiny_run_args
from tiny_models import SENTENCES

from st_ext.cli import EXIT_BAD_INPUT, main


@pytest.fixture
def triplets_file(tmp_path):
    rows = [
        {
            "q": f"{s} {i}",
            "pos": f"{SENTENCES[(i + 3) % len(SENTENCES)]} {i}",
            "neg": f"{SENTENCES[(i + 5) % len(SENTENCES)]} x{i}",
        }
        for i, s in enumerate(SENTENCES * 3)
    ]
    path = tmp_path / "triplets.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def run_args(model_dir, data, output_dir, *extra):
    return tiny_run_args(model_dir, data, output_dir, *extra, anchor="q", positive="pos")


def without(args: list[str], flag: str) -> list[str]:
    at = args.index(flag)
    return args[:at] + args[at + 2 :]


def metrics_of(output_dir: Path) -> dict:
    return json.loads((output_dir / "metrics.json").read_text())


def test_trainer_arguments_come_from_flags_and_the_config_file(tmp_path):
    from st_ext.cli.arguments import parse_train_args

    config = tmp_path / "run.yaml"
    config.write_text("warmup_ratio: 0.25\nsave_steps: '3'\nreport_to: [none]\nepochs: 2\nloss: cached_mnrl\n")
    _, settings, trainer = parse_train_args(
        [
            "--config",
            str(config),
            "--gradient-accumulation-steps",
            "2",
            "--lr-scheduler-type",
            "constant",
            "--batch-size",
            "16",
        ]
    )
    assert settings.loss == "cached_mnrl"
    assert trainer["warmup_ratio"] == 0.25 and trainer["save_steps"] == 3 and trainer["report_to"] == ["none"]
    assert trainer["num_train_epochs"] == 2.0 and trainer["per_device_train_batch_size"] == 16
    assert trainer["gradient_accumulation_steps"] == 2 and trainer["lr_scheduler_type"] == "constant"
    # The command's own defaults where nothing was said.
    assert trainer["save_strategy"] == "no" and trainer["seed"] == 0 and trainer["output_dir"] == "runs/st-ext"


def test_an_alias_and_its_full_name_in_one_file_are_refused(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("batch_size: 8\nper_device_train_batch_size: 16\n")
    assert main(["train", "--config", str(config)]) == EXIT_BAD_INPUT
    assert (
        "config: batch_size and per_device_train_batch_size are the same setting; keep one." in capsys.readouterr().err
    )


def test_trainer_arguments_reach_the_trainer(tiny_bert_dir, triplets_file, tmp_path, monkeypatch):
    from st_ext.training import trainer as trainer_module

    seen = {}
    original = trainer_module.SentenceTransformerTrainer.train

    def spy(self, *args, **kwargs):
        seen.update(
            accumulation=self.args.gradient_accumulation_steps,
            warmup=self.args.warmup_steps,
            max_grad=self.args.max_grad_norm,
        )
        return original(self, *args, **kwargs)

    monkeypatch.setattr(trainer_module.SentenceTransformerTrainer, "train", spy)
    extra = ["--gradient-accumulation-steps", "2", "--warmup-steps", "1", "--max-grad-norm", "0.5"]
    assert (
        main(run_args(tiny_bert_dir, triplets_file, tmp_path / "run", *extra, "--loss", "matryoshka_cached_mnrl")) == 0
    )
    assert seen == {"accumulation": 2, "warmup": 1, "max_grad": 0.5}


def test_bf16_trains_on_the_cpu_when_there_is_no_gpu(tiny_bert_dir, triplets_file, tmp_path, monkeypatch):
    """The flag's default (use_cpu False) must not undo the command's choice of the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # transformers 4.x exports bf16 to later Accelerators through ACCELERATE_MIXED_PRECISION; monkeypatch
    # restores the environment after the test, so later tests in this process do not train under bf16.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", os.environ.get("ACCELERATE_MIXED_PRECISION", "no"))
    assert (
        main(run_args(tiny_bert_dir, triplets_file, tmp_path / "run", "--bf16", "--loss", "matryoshka_cached_mnrl"))
        == 0
    )
    assert metrics_of(tmp_path / "run")["settings"]["trainer"]["bf16"] is True


def test_a_trainer_argument_conflict_is_one_line(tiny_bert_dir, triplets_file, tmp_path, capsys):
    extra = ["--load-best-model-at-end", "--save-strategy", "steps", "--eval-strategy", "no"]
    assert main(run_args(tiny_bert_dir, triplets_file, tmp_path / "run", *extra)) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("st-ext train: error: trainer arguments: "), err
    assert "load_best_model_at_end" in err[0]


def every_file(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(path.relative_to(folder)): (path.read_bytes(), path.stat().st_mtime_ns)
        for path in folder.rglob("*")
        if path.is_file()
    }


def test_checkpoints_are_kept_and_a_run_resumes_from_the_last(tiny_bert_dir, triplets_file, tmp_path, capsys):
    output = tmp_path / "run"
    saving = ["--save-strategy", "steps", "--save-steps", "1", "--loss", "matryoshka_cached_mnrl"]
    assert main(run_args(tiny_bert_dir, triplets_file, output, *saving)) == 0
    checkpoints = sorted(p.name for p in (output / "checkpoints").iterdir())
    assert checkpoints == ["checkpoint-1", "checkpoint-2"]
    assert metrics_of(output)["time"]["steps"] == 2
    assert "Writing model shards" not in capsys.readouterr().err, (
        "transformers' bar at each checkpoint, unless --verbose"
    )

    resumed = run_args(tiny_bert_dir, triplets_file, output, *saving, "--resume-from-checkpoint", "last")
    resumed[resumed.index("--max-steps") + 1] = "3"
    assert main(resumed) == 0
    assert f"resuming from {output / 'checkpoints' / 'checkpoint-2'} (step 2)" in capsys.readouterr().out.splitlines()
    # Steps 1 and 2 were restored from checkpoint-2, so this run trained step 3 only; its records keep
    # the checkpoint's run's steps, as measured then.
    first_rows = (output / "checkpoints" / "checkpoint-2" / "memory_per_step.csv").read_text().splitlines()
    time_report = metrics_of(output)["time"]
    assert (time_report["steps"], time_report["steps_this_run"], time_report["resumed_from_step"]) == (3, 1, 2)
    rows = (output / "memory_per_step.csv").read_text().splitlines()
    assert rows[:3] == first_rows and [row.split(",")[0] for row in rows[1:]] == ["1", "2", "3"]
    state = json.loads((output / "checkpoints" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    # The newest two checkpoints are kept unless --save-total-limit says otherwise.
    assert sorted(p.name for p in (output / "checkpoints").iterdir()) == ["checkpoint-2", "checkpoint-3"]
    assert (output / "model" / "modules.json").is_file()


def test_a_last_batch_of_one_row_is_dropped(tiny_bert_dir, triplets_file, tmp_path, capsys):
    """19 training rows in batches of 9: the third batch would hold one row, with no in-batch negative."""
    output = tmp_path / "run"
    by_epochs = without(without(run_args(tiny_bert_dir, triplets_file, output), "--max-steps"), "--batch-size")
    assert main(by_epochs + ["--batch-size", "9", "--epochs", "2"]) == 0
    assert "the last batch of each epoch would hold 1 row (19 rows in batches of 9)" in capsys.readouterr().out
    metrics = metrics_of(output)
    assert metrics["time"]["steps"] == 4 and metrics["data"]["last_batch"] == "dropped: it would hold 1 row"

    assert main(by_epochs + ["--batch-size", "7", "--epochs", "1", "--output-dir", str(tmp_path / "kept")]) == 0
    assert "the last batch of each epoch" not in capsys.readouterr().out
    assert metrics_of(tmp_path / "kept")["time"]["steps"] == 3, "a last batch of five rows trains"


def test_resuming_a_finished_run_publishes_nothing(tiny_bert_dir, triplets_file, tmp_path, capsys):
    """Resuming a run that reached its last step trains nothing, so it must not replace the results
    (with a header-only CSV and an empty plot) nor touch a checkpoint: one line says so."""
    output = tmp_path / "run"
    saving = ["--save-strategy", "steps", "--save-steps", "1", "--loss", "matryoshka_cached_mnrl"]
    assert main(run_args(tiny_bert_dir, triplets_file, output, *saving)) == 0
    finished = every_file(output)
    capsys.readouterr()

    resumed = run_args(tiny_bert_dir, triplets_file, output, *saving, "--resume-from-checkpoint", "last")
    assert main(resumed) == 0  # --max-steps 2: known complete before anything loads
    assert capsys.readouterr().out.splitlines() == [
        f"st-ext train: already complete at step 2 ({output / 'checkpoints' / 'checkpoint-2'} ends the run these "
        f"settings ask for); nothing was trained or written, and {output} is unchanged. Raise --max-steps or --epochs to train on."
    ]
    # By epochs the step count depends on the data, so the trainer finds out: 19 training rows in batches of
    # 10 make 2 steps an epoch, all done at checkpoint-2.
    by_epochs = without(without(resumed, "--max-steps"), "--batch-size") + ["--batch-size", "10", "--epochs", "1"]
    assert main(by_epochs) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"resuming from {output / 'checkpoints' / 'checkpoint-2'} (step 2)"
    assert printed[-1].startswith("st-ext train: already complete at step 2 (")
    assert every_file(output) == finished


@pytest.mark.parametrize(
    "resume, message",
    [
        ("last", "resume_from_checkpoint: no checkpoint in"),
        ("__TMP__", "is not a checkpoint (it has no trainer_state.json)"),
    ],
)
def test_resuming_without_a_checkpoint_is_one_line(tiny_bert_dir, triplets_file, tmp_path, capsys, resume, message):
    args = run_args(
        tiny_bert_dir,
        triplets_file,
        tmp_path / "run",
        "--resume-from-checkpoint",
        resume.replace("__TMP__", str(tmp_path)),
    )
    assert main(args) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert err.startswith("st-ext train: error: ") and message in err and "\n" not in err


@pytest.mark.parametrize("loss", ["matryoshka_cached_gist", "triplet"])
def test_hard_negatives_are_trained_on(tiny_bert_dir, triplets_file, tmp_path, capsys, loss):
    args = run_args(
        tiny_bert_dir, triplets_file, tmp_path / "run", "--negative-columns", "neg", "--loss", loss, "--verbose"
    )
    if loss == "triplet":
        args = without(args, "--mini-batch-size")  # a non-cached loss takes none
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "training rows (anchor, positive, negative)" in printed
    # --verbose prints the guide's release report, which otherwise goes to metrics.json only.
    assert ("malloc_trim" in printed) == (loss == "matryoshka_cached_gist")
    assert metrics_of(tmp_path / "run")["data"]["columns"] == ["anchor", "positive", "negative"]


def test_a_triplet_loss_without_negatives_says_which_flag_to_pass(tiny_bert_dir, triplets_file, tmp_path, capsys):
    args = without(run_args(tiny_bert_dir, triplets_file, tmp_path / "run", "--loss", "triplet"), "--mini-batch-size")
    assert main(args) == EXIT_BAD_INPUT
    assert "or one --negative-columns." in capsys.readouterr().err


def test_an_eval_file_holds_the_evaluation_pairs(tiny_bert_dir, triplets_file, tmp_path, capsys):
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("\n".join(json.dumps({"q": f"query {i}", "pos": f"document {i}"}) for i in range(12)))
    assert main(run_args(tiny_bert_dir, triplets_file, tmp_path / "run", "--eval-data", str(held_out))) == 0
    data = metrics_of(tmp_path / "run")["data"]
    assert data["eval_pairs"] == 12 and data["train_rows"] == 3 * 8  # every row of --data trains
    assert (
        main(
            run_args(
                tiny_bert_dir, triplets_file, tmp_path / "run", "--eval-data", str(held_out), "--eval-fraction", "0.3"
            )
        )
        == EXIT_BAD_INPUT
    )
    assert "eval_fraction: --eval-data holds the evaluation pairs" in capsys.readouterr().err


def test_metrics_report_settings_data_memory_time_and_versions(tiny_bert_dir, triplets_file, tmp_path, capsys):
    import sentence_transformers

    assert main(run_args(tiny_bert_dir, triplets_file, tmp_path / "run", "--loss", "matryoshka_cached_mnrl")) == 0
    printed = capsys.readouterr().out
    metrics = metrics_of(tmp_path / "run")
    assert metrics["settings"]["loss"] == "matryoshka_cached_mnrl" and metrics["settings"]["trainer"]["max_steps"] == 2
    assert metrics["data"]["train_rows"] + metrics["data"]["eval_pairs"] == 24
    memory = metrics["memory"]
    assert memory["step_peak_mib"] > 0 and memory["meter"] and "above the level at the start" in memory["counts"]
    assert 0 < memory["forward_backward_peak_mib"] <= memory["step_peak_mib"]
    reference = memory["uncached_reference"]
    assert reference["loss"] == "matryoshka_mnrl" and reference["batch_size"] == 4 and reference["peak_mib"] > 0
    assert reference["trained_loss"] == "matryoshka_cached_mnrl" and reference["batch"] == "the first step's batch"
    assert reference["counts"] == memory["forward_backward_counts"], "the plot's two lines count the same"
    assert metrics["time"]["steps"] == 2 and metrics["time"]["seconds_per_step_median"] > 0
    assert metrics["versions"]["sentence_transformers"] == sentence_transformers.__version__
    # 5 held-out pairs: every figure moves in steps of 20%, and the run says so.
    assert any("only 5 held-out pairs" in warning for warning in metrics["warnings"])
    assert "warning: only 5 held-out pairs" in printed
    assert "matryoshka_mnrl (no caching), forward+backward on the first step's batch: " in printed
    header = (tmp_path / "run" / "memory_per_step.csv").read_text().splitlines()[0]
    assert header == "step,peak_mib,forward_backward_peak_mib,seconds,device,meter"


def test_the_reference_peak_grows_with_the_batch_and_changes_nothing(tiny_bert_dir):
    from st_ext import SentenceTransformer
    from st_ext._compat import preprocess
    from st_ext.cli.reference_peak import measure_reference_peak
    from st_ext.losses.registry import build_loss
    from st_ext.training.memory_checkpoints import memory_losses

    model = SentenceTransformer(str(tiny_bert_dir), device="cpu")
    rows = [{"anchor": f"{s} {i}", "positive": f"{s} again {i}"} for i, s in enumerate(SENTENCES * 8)]

    def features(batch):
        return [preprocess(model, [row[column] for row in batch], "cpu") for column in ("anchor", "positive")]

    trained = build_loss("xbm_cached_mnrl", model, mini_batch_size=2)
    trained(features(rows[:4]), None).backward()  # a step's rows in its queue
    queue = memory_losses(trained)["loss"].memory
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, 0.5)
    rng = torch.random.get_rng_state()
    small = measure_reference_peak("xbm_cached_mnrl", trained, model, features(rows[:4]), None, [32], "cpu")
    large = measure_reference_peak("xbm_cached_mnrl", trained, model, features(rows[:32]), None, [32], "cpu")
    assert small.loss == "xbm_mnrl" and small.trained_loss == "xbm_cached_mnrl" and large.batch_size == 32
    assert large.peak_mib > 2 * small.peak_mib > 0
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters()), "the model's gradients"
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert memory_losses(trained)["loss"].memory is queue, "the trained loss's queue"
    plain = build_loss("mnrl", model)
    assert measure_reference_peak("mnrl", plain, model, features(rows[:4]), None, [32], "cpu") is None, (
        "nothing to compare"
    )


@pytest.fixture
def offline_hub(monkeypatch):
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize(
    "flag, name, message",
    [
        (
            "--model",
            "st-ext-tests/no-such-model",
            "model: 'st-ext-tests/no-such-model' is not a local directory and is not in the local Hugging Face cache (HF_HUB_OFFLINE is set)",
        ),
        (
            "--data",
            "st-ext-tests/no-such-dataset",
            "data: 'st-ext-tests/no-such-dataset' is not a local file and cannot be loaded from the Hub",
        ),
    ],
)
def test_hub_names_offline_are_one_line(
    tiny_bert_dir, triplets_file, tmp_path, capsys, offline_hub, flag, name, message
):
    args = run_args(tiny_bert_dir, triplets_file, tmp_path / "run")
    args[args.index(flag) + 1] = name
    assert main(args) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert err.startswith("st-ext train: error: ") and message in err and "\n" not in err, err


@pytest.mark.parametrize("flag", ["--model", "--data"])
def test_an_unreachable_hub_is_one_line_at_once(tiny_bert_dir, triplets_file, tmp_path, capsys, monkeypatch, flag):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")  # .invalid never resolves
    args = run_args(tiny_bert_dir, triplets_file, tmp_path / "run")
    args[args.index(flag) + 1] = "st-ext-tests/no-such-thing"
    assert main(args) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert "hub.invalid cannot be reached" in err and "\n" not in err, err


def test_the_console_script_answers_help_without_torch_and_errors_in_one_line(tmp_path):
    script = Path(sys.executable).with_name("st-ext")
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, st_ext.cli.main; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == "False", "st-ext --help must not wait for torch"
    top = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert top.returncode == 0 and "train" in top.stdout
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    failed = subprocess.run(
        [str(script), "train", "--model", "st-ext-tests/no-such-model", "--output-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert failed.returncode == EXIT_BAD_INPUT
    assert failed.stderr.strip().splitlines() == [
        "st-ext train: error: model: 'st-ext-tests/no-such-model' is not a local directory and is not in the local "
        "Hugging Face cache (HF_HUB_OFFLINE is set); download it once online, or pass a local directory."
    ]
    # An abbreviated flag is refused (not taken for --anchor-column), in one line without the usage block.
    abbreviated = subprocess.run(
        [str(script), "train", "--anchor_colum", "q"], capture_output=True, text=True, env=env
    )
    assert abbreviated.returncode == EXIT_BAD_INPUT and "usage:" not in abbreviated.stdout + abbreviated.stderr
    assert abbreviated.stderr.splitlines() == [
        "st-ext train: error: unrecognized arguments: --anchor_colum q (`st-ext train --help` lists every setting)"
    ]


@pytest.mark.parametrize("budget_mb", [4, 8])
def test_an_auto_budget_bounds_every_measured_training_step(tiny_bert_dir, tmp_path, budget_mb):
    """The budget means the step's peak as the CSV measures it (the optimizer's update and the step
    that probes included), not one mini-batch's forward and backward."""
    import csv

    rows = [
        {"q": f"{s} {i} " * 3, "pos": f"{SENTENCES[(i + 3) % len(SENTENCES)]} {i}"}
        for i, s in enumerate(SENTENCES * 8)
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    args = run_args(
        tiny_bert_dir, data, tmp_path / "run", "--memory-budget-mb", str(budget_mb), "--loss", "matryoshka_cached_mnrl"
    )
    args[args.index("--batch-size") + 1] = "32"
    args[args.index("--max-steps") + 1] = "3"
    args[args.index("--mini-batch-size") + 1] = "auto"
    assert main(args) == 0
    peaks = [float(row["peak_mib"]) for row in csv.DictReader((tmp_path / "run" / "memory_per_step.csv").open())]
    assert len(peaks) == 3 and all(0 < peak <= budget_mb for peak in peaks), peaks
    assert "mini_batch_size auto -> " in metrics_of(tmp_path / "run")["memory"]["auto_mini_batch"]
