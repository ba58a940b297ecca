"""The quality-at-equal-memory benchmark's smallest configuration, end to end on a tiny local model, so that
``make bench-quality`` cannot rot: every configuration is built, measured, trained, evaluated and written."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_quality.py"


def test_the_smallest_configuration_writes_its_table_plot_and_results(tiny_bert_dir, tmp_path):
    bench = runpy.run_path(str(BENCHMARK), run_name="bench_quality")
    out = tmp_path / "out"
    size = ["--small-batch", "2", "--factors", "2", "--seeds", "0", "--train-pairs", "12", "--eval-pairs", "8"]
    written = bench["main"](["--model", str(tiny_bert_dir), *size, "--max-seq-length", "16", "--out", str(out)])

    results = json.loads(written["results"].read_text())
    assert results["complete"]
    assert results["settings"]["dims"] == [32, 10, 5], "the model's dimension, a third and a sixth"
    assert results["data"]["train_rows"] == 12 and results["data"]["held_out_pairs"] == 8
    assert results["budget_mib"] > 0 and results["uncached_peak_mib_at"]["4"] > 0
    labels = [outcome["label"] for outcome in results["outcomes"]]
    with_directions = [  # where MNRL has directions (not 4.x)
        "st_ext CachedMNRL, three directions, B=4",
        "st_ext CrossBatchMemory(CachedMNRL, three directions), document queue + query bank, B=4",
    ]
    assert labels == [
        "upstream MNRL, b=2",
        "upstream CachedMNRL, B=4",
        "st_ext CachedMNRL, B=4",
        "st_ext CachedMNRL auto, B=4",
        "st_ext Matryoshka(CachedGIST), guide offloaded, B=4",
        "st_ext CrossBatchMemory(CachedMNRL), document queue, B=4",
        *(with_directions if bench["has_directions"]() else []),
    ]
    for outcome in results["outcomes"]:
        if outcome["peak_mib"] is None:  # only the auto mode may find the budget too small, and says so
            assert outcome["label"].startswith("st_ext CachedMNRL auto") and outcome["note"].startswith("refused")
            continue
        assert outcome["peak_mib"] > 0 and len(outcome["seconds"]) == 1
        if outcome["mini_batch"].startswith("auto"):  # it measured on the first batch, inside the timed loop
            assert outcome["measurements"][0] >= 1
            assert 0 < outcome["measuring_seconds"][0] < outcome["seconds"][0]
        else:
            assert outcome["measurements"] == [] and outcome["measuring_seconds"] == []
        (scores,) = outcome["scores"]
        assert set(scores) == {"32", "10", "5"}
        assert all(0 <= scores[dim][metric] <= 1 for dim in scores for metric in ("ndcg@10", "mrr@10"))

    table = written["table"].read_text()
    assert table.count("\n| ") == 1 + len(labels), "the before-training row and one row per configuration"
    assert (
        "Partial" not in table
        and "NDCG@10 @32" in table
        and "MRR@10 @5" in table
        and f"peaks at {results['budget_mib']} MiB" in table
    )
    assert written["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for outcome in results["outcomes"]:
        row = next(line for line in table.splitlines() if line.startswith(f"| {outcome['label']} |"))
        assert ("measuring: " in row) == bool(outcome["measurements"])

    # A machine without matplotlib writes no plot; the plot and table are drawn later from results.json.
    elsewhere = tmp_path / "elsewhere"
    redrawn = bench["main"](["--from-results", str(written["results"]), "--out", str(elsewhere)])
    assert redrawn["table"].read_text() == table and redrawn["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(bench["write_outputs"](results, tmp_path / "bare", with_plot=False)) == {"results", "table"}


def test_the_auto_rows_say_how_often_and_how_long_it_measured_and_whether_it_checkpoints():
    bench = runpy.run_path(str(BENCHMARK), run_name="bench_quality")
    choice = bench["AutoChoice"](size=16, rows=64, longest_row=32, budget_bytes=1, checkpointing=True, minibatches=4)
    choice.kept = 2
    assert bench["auto_label"](choice) == "auto: 16 checkpointed, 2 of 4 graphs kept"
    choice.checkpointing = False
    assert bench["auto_label"](choice) == "auto: 16, 2 of 4 graphs kept"
    auto = {"seconds": [40.0, 42.0], "measurements": [3, 4], "measuring_seconds": [4.0, 5.0]}
    assert bench["train_seconds_cell"](auto) == "41.0 ± 1.4 (measuring: 3-4×, 4.5 s)"
    assert bench["train_seconds_cell"]({"seconds": [29.0]}) == "29.0 ± 0.0", "an earlier results.json has no counts"


def test_batches_hold_no_text_twice_and_no_batch_of_one_row():
    batches = runpy.run_path(str(BENCHMARK), run_name="bench_quality")["batches"]
    distinct = [{"anchor": f"q{i}", "positive": f"d{i}"} for i in range(9)]
    epoch = batches(distinct, 4, seed=0)
    assert sorted(len(batch) for batch in epoch) == [4, 5], "the ninth row joins the batch before it"
    assert sorted(row["anchor"] for batch in epoch for row in batch) == [row["anchor"] for row in distinct]

    repeating = [{"anchor": f"q{i}", "positive": f"d{i % 5}"} for i in range(11)]
    for batch in batches(repeating, 4, seed=0):
        texts = [text for row in batch for text in row.values()]
        assert len(texts) == len(set(texts)) and len(batch) > 1
