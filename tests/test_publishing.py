"""Publishing the CLI's model: a kill at any step of the swap leaves the old or the new model whole,
and the next run finishes or rolls back what it finds."""

from __future__ import annotations

import pytest

from st_ext.cli import publishing

STEPS = ["marked", "moved aside", "moved in"]


class Killed(BaseException):
    """Stands in for SIGKILL: nothing after the fault point runs."""


def write_model(folder, content: str):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "weights.bin").write_text(content)
    (folder / "config.json").write_text("{}")


def contents(folder) -> str:
    return (folder / "weights.bin").read_text()


@pytest.mark.parametrize("step", STEPS)
def test_a_kill_during_the_swap_leaves_a_whole_model_after_recovery(tmp_path, monkeypatch, step):
    target = tmp_path / "model"
    write_model(target, "old")
    staging = publishing.staging_folder(target)
    write_model(staging, "new")

    def kill_at(reached):
        if reached == step:
            raise Killed

    monkeypatch.setattr(publishing, "fault_point", kill_at)
    with pytest.raises(Killed):
        publishing.publish(staging, target)
    monkeypatch.setattr(publishing, "fault_point", lambda reached: None)

    done = publishing.recover(target)
    assert contents(target) == "new", done  # the new model was complete at every step: the swap is finished
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"], "nothing hidden is left behind"
    assert not (target / publishing.COMPLETE_MARK).exists()


def test_an_unfinished_staging_folder_is_deleted_and_the_old_model_kept(tmp_path):
    target = tmp_path / "model"
    write_model(target, "old")
    staging = publishing.staging_folder(target)
    write_model(staging, "half")  # never marked complete: the run died while saving
    assert publishing.recover(target) == [f"deleted the unfinished {staging.name}"]
    assert contents(target) == "old" and not staging.exists()


def test_a_swap_stopped_before_a_complete_model_existed_rolls_back(tmp_path):
    target = tmp_path / "model"
    write_model(publishing.aside(target), "old")  # moved aside, then the run died with nothing complete
    assert "restored the previous" in publishing.recover(target)[0]
    assert contents(target) == "old"


def test_published_folders_get_the_users_umask(tmp_path):
    import os
    import stat

    previous = os.umask(0o022)
    try:
        target = tmp_path / "model"
        staging = publishing.staging_folder(target)
        write_model(staging, "new")
        publishing.publish(staging, target)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
