"""What a training run leaves behind: a per-step memory CSV, the metrics and plots, written plainly (with
the user's umask) into the staging folder the job publishes whole (:mod:`st_ext.cli.publishing`).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import time
from collections.abc import Callable
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from st_ext.memory import PeakMemory, measure_peak


def write_file(path: Path, data: bytes | str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


class LossPerDimension(TrainerCallback):
    """Logs ``loss_per_dim`` beside each ``loss`` (and ``train_loss``): a Matryoshka loss is the weighted sum
    of the loss at each of its dimensions, a figure that grows with their number; the sum over the weights'
    total (with st-ext train's equal weights, the mean over the dimensions) is on an unwrapped loss's scale. It
    is no one dimension's loss.

    Only what is logged changes; it must be added before the callback that prints the logs."""

    #: The logged figures it divides, and the name each quotient is logged under.
    PER_DIMENSION = {"loss": "loss_per_dim", "train_loss": "train_loss_per_dim"}

    def __init__(self, total_weight: float):
        self.total_weight = total_weight

    def on_log(self, args, state, control, logs=None, **kwargs):
        for name, per_dimension in self.PER_DIMENSION.items():
            if logs is not None and isinstance(logs.get(name), (int, float)):
                logs[per_dimension] = logs[name] / self.total_weight


class StepMemoryRecorder(TrainerCallback):
    """Measures each optimizer step twice over: the whole step (``peak_mib``: what ``mini_batch_size="auto"``'s
    budget bounds), and its part up to the optimizer's update (``forward_backward_peak_mib``: what caching
    changes; None where the trainer gave no ``on_pre_optimizer_step``).

    ``before_first_step`` runs once, before the first step's measurement opens (the uncached reference
    is measured there, on that step's batch). Each checkpoint gets the rows so far
    (:data:`CHECKPOINT_FILE`), and a run resumed from it starts from them (:meth:`resume_from`), so its
    CSV, plot and figures cover every step.
    """

    COLUMNS = ("step", "peak_mib", "forward_backward_peak_mib", "seconds", "device", "meter")
    CHECKPOINT_FILE = "memory_per_step.csv"

    def __init__(self, device, before_first_step: Callable[[], None] | None = None):
        self.device = device
        self.rows: list[dict] = []
        self.before_first_step = before_first_step
        self._active: contextlib.AbstractContextManager | None = None
        self._peak: PeakMemory | None = None
        self._inner: contextlib.AbstractContextManager | None = None
        self._inner_peak: PeakMemory | None = None
        self._forward_backward: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.before_first_step is not None:
            first, self.before_first_step = self.before_first_step, None
            first()
        self._active = measure_peak(self.device)
        self._peak = self._active.__enter__()
        self._inner = measure_peak(self.device)
        self._inner_peak = self._inner.__enter__()
        self._forward_backward = None
        self._started = time.perf_counter()

    def resume_from(self, checkpoint: str | Path, step: int) -> None:
        """Start from the rows the checkpoint's run recorded up to ``step`` (none from a checkpoint saved
        without them)."""
        path = Path(checkpoint) / self.CHECKPOINT_FILE
        if not path.is_file():
            return
        with path.open(newline="") as file:
            earlier = [_typed_row(row) for row in csv.DictReader(file)]
        self.rows = [row for row in earlier if row["step"] <= step] + self.rows

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if state.is_world_process_zero and folder.is_dir():
            self.write_csv(folder / self.CHECKPOINT_FILE)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._inner is not None:
            self._forward_backward = round(self._close_inner().peak_mib, 2)

    def on_step_end(self, args, state, control, **kwargs):
        if self._active is None:
            return
        self._close_inner()
        self._active.__exit__(None, None, None)
        self.rows.append(
            {
                "step": state.global_step,
                "peak_mib": round(self._peak.peak_mib, 2),
                "forward_backward_peak_mib": self._forward_backward,
                "seconds": round(time.perf_counter() - self._started, 4),
                "device": str(self._peak.device),
                "meter": self._peak.meter,
            }
        )
        self._active = self._peak = None

    def _close_inner(self) -> PeakMemory | None:
        """Close the forward-and-backward window (measurements nest: it closes before the step's) and return
        its peak; ``on_step_end`` discards it, since by then it spanned the whole step."""
        inner, peak, self._inner, self._inner_peak = self._inner, self._inner_peak, None, None
        if inner is not None:
            inner.__exit__(None, None, None)
        return peak

    def stop(self) -> None:
        """End the measurement of a step that will not end (an interrupt, an error), unrecorded: on the
        CPU the profiler would otherwise run on and warn about each block freed while the process exits."""
        self._close_inner()
        if self._active is not None:
            active, self._active, self._peak = self._active, None, None
            active.__exit__(None, None, None)

    def write_csv(self, path: Path) -> Path:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=self.COLUMNS)
        writer.writeheader()
        writer.writerows(self.rows)
        return write_file(path, buffer.getvalue())


def _typed_row(row: dict[str, str]) -> dict:
    """A row as :meth:`StepMemoryRecorder.write_csv` wrote it, with its numbers read back (an empty
    ``forward_backward_peak_mib`` is None)."""
    forward_backward = row["forward_backward_peak_mib"]
    return {
        "step": int(row["step"]),
        "peak_mib": float(row["peak_mib"]),
        "forward_backward_peak_mib": float(forward_backward) if forward_backward else None,
        "seconds": float(row["seconds"]),
        "device": row["device"],
        "meter": row["meter"],
    }


def write_metrics(path: Path, before: dict, after: dict, report: dict) -> Path:
    """Metrics before and after training, per Matryoshka dim, and the run's ``report``, as JSON."""
    payload = {"before": {str(k): v for k, v in before.items()}, "after": {str(k): v for k, v in after.items()}}
    return write_file(path, json.dumps({**payload, **report}, indent=2))


def plot_memory(path: Path, rows: list[dict], reference, loss: str) -> Path:
    """Each step's forward-and-backward peak of ``loss`` from zero and, as a dashed line, the same figure of
    the loss without caching on the first step's batch (a :class:`~st_ext.cli.reference_peak.ReferencePeak`),
    as a PNG. The whole step's peak, the optimizer's update and state included, is the CSV's ``peak_mib``."""
    from matplotlib.ticker import MaxNLocator

    from st_ext.cli.reference_peak import FORWARD_BACKWARD_SHORT

    figure, axes = _figure()
    figure.set_size_inches(6.4, 4.8)
    measured = [r for r in rows if r.get("forward_backward_peak_mib") is not None]
    tops = [r["forward_backward_peak_mib"] for r in measured]
    axes.plot(
        [r["step"] for r in measured],
        tops,
        marker="o",
        label=f"{loss} (trained{', cached' if reference is not None else ''}), each step's batch",
    )
    label = f"no uncached reference: {loss} does not cache" if reference is None else reference.label()
    if reference is not None and reference.peak_mib is not None:
        axes.axhline(reference.peak_mib, linestyle="--", color="tab:red", label=label)
        tops.append(reference.peak_mib)
    else:  # no reference, or out of memory: no line, but the legend says so
        axes.plot([], [], linestyle="--", color="tab:red", label=label)
    axes.set_ylim(0, max(tops, default=1.0) * 1.15 or 1.0)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("MiB: forward+backward peak above the level at step start", fontsize=9)
    meter = rows[0]["meter"] if rows else "no steps"
    axes.set_title(f"Peak memory per step, both lines: {FORWARD_BACKWARD_SHORT}\n({meter})", fontsize=8)
    axes.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14))
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
