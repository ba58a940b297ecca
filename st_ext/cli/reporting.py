"""What a training run leaves behind: a per-step memory CSV, metric tables and plots.

The job writes them into a staging folder that it publishes whole (:mod:`st_ext.cli.publishing`),
so they are written plainly here, with the user's umask.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import time
from pathlib import Path

from transformers import TrainerCallback

from st_ext.memory import PeakMemory, measure_peak


def write_file(path: Path, data: bytes | str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


class StepMemoryRecorder(TrainerCallback):
    """Measures each optimizer step's peak memory with :func:`st_ext.memory.measure_peak`."""

    def __init__(self, device):
        self.device = device
        self.rows: list[dict] = []
        self._active: contextlib.AbstractContextManager | None = None
        self._peak: PeakMemory | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._active = measure_peak(self.device)
        self._peak = self._active.__enter__()
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._active is None:
            return
        self._active.__exit__(None, None, None)
        self.rows.append(
            {
                "step": state.global_step,
                "peak_mib": round(self._peak.peak_mib, 2),
                "seconds": round(time.perf_counter() - self._started, 4),
                "device": str(self._peak.device),
                "meter": self._peak.meter,
            }
        )
        self._active = self._peak = None

    def stop(self) -> None:
        """End the measurement of a step that will not end (an interrupt, an error), unrecorded: on the
        CPU the profiler would otherwise run on and warn about each block freed while the process exits."""
        if self._active is not None:
            active, self._active, self._peak = self._active, None, None
            active.__exit__(None, None, None)

    def write_csv(self, path: Path) -> Path:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=["step", "peak_mib", "seconds", "device", "meter"])
        writer.writeheader()
        writer.writerows(self.rows)
        return write_file(path, buffer.getvalue())


def write_metrics(path: Path, before: dict, after: dict, report: dict | None = None) -> Path:
    """Metrics before and after training, per Matryoshka dim, and the run's ``report`` (settings, data,
    memory, time, versions), as JSON."""
    payload = {"before": {str(k): v for k, v in before.items()}, "after": {str(k): v for k, v in after.items()}}
    return write_file(path, json.dumps({**payload, **(report or {})}, indent=2))


#: What every memory figure of a run counts; the CSV's meter column names the instrument.
MEMORY_MEANING = "peak above the level at step start"


def plot_memory(path: Path, rows: list[dict], reference=None) -> Path:
    """Peak memory per optimizer step from zero, and the uncached loss's peak at the same batch
    (a :class:`~st_ext.cli.reference_peak.ReferencePeak`) as a dashed line, as a PNG."""
    figure, axes = _figure()
    axes.plot([r["step"] for r in rows], [r["peak_mib"] for r in rows], marker="o", label="st_ext step peak")
    tops = [r["peak_mib"] for r in rows]
    if reference is not None and reference.peak_mib is not None:
        axes.axhline(reference.peak_mib, linestyle="--", color="tab:red", label=reference.label())
        tops.append(reference.peak_mib)
    axes.set_ylim(0, max(tops, default=1.0) * 1.15 or 1.0)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel(f"memory, MiB ({MEMORY_MEANING})")
    axes.set_title(f"Peak memory per step ({rows[0]['meter'] if rows else 'no steps'})", fontsize=9)
    axes.legend(fontsize=8, loc="best")
    return _save(figure, path)


def plot_metric_by_dim(path: Path, before: dict, after: dict, metric: str = "ndcg@10") -> Path:
    """``metric`` against Matryoshka dimension, before and after training, as a PNG."""
    figure, axes = _figure()
    dims = sorted(before)
    axes.plot(dims, [before[d][metric] for d in dims], marker="o", label="before")
    axes.plot(dims, [after[d][metric] for d in dims], marker="o", label="after")
    axes.set_xscale("log", base=2)
    axes.set_xticks(dims, [str(d) for d in dims])
    axes.set_xlabel("embedding dimension")
    axes.set_ylabel(metric)
    axes.set_title(f"{metric} by Matryoshka dimension")
    axes.legend()
    return _save(figure, path)


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4), dpi=100)
    axes.grid(True, alpha=0.3)
    return figure, axes


def _save(figure, path: Path) -> Path:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return write_file(path, buffer.getvalue())
