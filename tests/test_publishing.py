"""Publishing a run's results: a kill at any step, or a write that fails, leaves one whole run in the
output directory (never a mix), and the next run finishes or rolls back what it finds."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from st_ext.cli import EXIT_BAD_INPUT, main, publishing

STEPS = ["marked", "moved aside", "moved in"]
RESULTS = ("model", "metrics.json", "ndcg_by_dim.png")


class Killed(BaseException):
    """Stands in for SIGKILL: nothing after the fault point runs."""


def write_run(folder, content: str) -> None:
    (folder / "model").mkdir(parents=True, exist_ok=True)
    (folder / "model" / "weights.bin").write_text(content)
    (folder / "metrics.json").write_text(content)
    (folder / "ndcg_by_dim.png").write_text(content)


def run_contents(folder) -> set[str]:
    """Which run each result comes from: one element when the results are one run's."""
    return {
        (folder / "model" / "weights.bin").read_text(),
        (folder / "metrics.json").read_text(),
        (folder / "ndcg_by_dim.png").read_text(),
    }


def visible(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("step", STEPS)
def test_a_kill_during_the_swap_leaves_one_whole_run_after_recovery(tmp_path, monkeypatch, step):
    write_run(tmp_path, "old")
    staging = publishing.staging_folder(tmp_path)
    write_run(staging, "new")

    def kill_at(reached):
        if reached == step:
            raise Killed

    monkeypatch.setattr(publishing, "fault_point", kill_at)
    with pytest.raises(Killed):
        publishing.publish(staging, tmp_path)
    monkeypatch.setattr(publishing, "fault_point", lambda reached: None)

    done = publishing.recover(tmp_path)
    assert run_contents(tmp_path) == {"new"}, done  # the new run was complete at every step: it is finished
    assert visible(tmp_path) == sorted(RESULTS), "nothing hidden is left behind"


def test_an_unfinished_staging_folder_is_deleted_and_the_old_run_kept(tmp_path):
    write_run(tmp_path, "old")
    staging = publishing.staging_folder(tmp_path)
    write_run(staging, "half")  # never marked complete: the run died while writing
    assert publishing.recover(tmp_path) == [f"deleted the unfinished {staging.name}"]
    assert run_contents(tmp_path) == {"old"} and not staging.exists()


def test_results_moved_aside_without_a_complete_run_are_restored(tmp_path):
    write_run(tmp_path / publishing.PREVIOUS, "old")
    done = publishing.recover(tmp_path)
    assert len(done) == len(RESULTS) and all("restored the previous" in line for line in done)
    assert run_contents(tmp_path) == {"old"} and visible(tmp_path) == sorted(RESULTS)


def test_other_files_and_stale_trainer_folders(tmp_path):
    """The user's own files are never touched; a trainer folder a kill left behind is deleted."""
    (tmp_path / "notes.txt").write_text("mine")
    write_run(tmp_path, "old")
    stale = publishing.trainer_folder(tmp_path)
    (stale / "checkpoint").write_text("x")
    assert publishing.recover(tmp_path) == [f"deleted the stale trainer folder {stale.name}"]
    staging = publishing.staging_folder(tmp_path)
    write_run(staging, "new")
    publishing.publish(staging, tmp_path)
    assert run_contents(tmp_path) == {"new"} and (tmp_path / "notes.txt").read_text() == "mine"
    assert visible(tmp_path) == sorted([*RESULTS, "notes.txt"])


def test_published_results_get_the_users_umask(tmp_path):
    previous = os.umask(0o022)
    try:
        staging = publishing.staging_folder(tmp_path)
        write_run(staging, "new")
        publishing.publish(staging, tmp_path)
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "model").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "metrics.json").stat().st_mode) == 0o644


def train_into(model_dir, output) -> int:
    """One short ``st-ext train`` run of the tiny model into ``output``, with the user's usual umask."""
    previous = os.umask(0o022)
    try:
        return main(
            [
                "train",
                "--model",
                str(model_dir),
                "--max-steps",
                "1",
                "--batch-size",
                "4",
                "--mini-batch-size",
                "2",
                "--max-pairs",
                "40",
                "--matryoshka-dims",
                "32",
                "16",
                "--output-dir",
                str(output),
            ]
        )
    finally:
        os.umask(previous)


def test_a_full_disk_leaves_the_earlier_run_whole(tiny_bert_dir, tmp_path, monkeypatch, capsys):
    """The model and metrics are written, then a plot hits a full disk: the output directory keeps the
    earlier run, not the new model beside the old plot, and the error is one line."""
    from st_ext.cli import job

    output = tmp_path / "run"
    write_run(output, "old")

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(job, "plot_metric_by_dim", disk_full)
    assert train_into(tiny_bert_dir, output) == EXIT_BAD_INPUT
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "No space left on device" in errors[0] and "unchanged" in errors[0], errors
    assert run_contents(output) == {"old"} and visible(output) == sorted(RESULTS)


def test_a_full_disk_while_safetensors_writes_the_model_is_one_line(tiny_bert_dir, tmp_path, monkeypatch, capsys):
    """safetensors reports a failed write as its own error type, not an OSError (the message is the one it gives
    when a tmpfs fills up under it). The error is one line that names the folder and the space the weights need,
    and the earlier run stays whole."""
    from safetensors import SafetensorError

    from st_ext.cli import job

    output = tmp_path / "run"
    write_run(output, "old")

    def disk_full(self, path, *args, **kwargs):
        Path(path).mkdir(parents=True)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(job.SentenceTransformer, "save", disk_full)
    assert train_into(tiny_bert_dir, output) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert f"writing the results to {output} failed" in errors[0], errors
    assert "No space left on device" in errors[0] and "weights alone need" in errors[0], errors
    assert run_contents(output) == {"old"} and visible(output) == sorted(RESULTS)
