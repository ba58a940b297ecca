"""Peak memory of a block of code, measured rather than estimated, by one meter per device:

* CUDA: the caching allocator's peak (``torch.cuda.max_memory_allocated``) after
  ``reset_peak_memory_stats``, minus what was allocated on entry.
* CPU: the torch profiler's allocation events, replayed in time order. It counts tensor storage
  only (not the Python heap), which is the part that activations, graphs and caches occupy.

Figures are above the level on entry: the peak, and what is still allocated on exit (``end_bytes``: what
the block leaves alive, such as a graph it keeps). Measurements nest (a training step measured around a loss
whose ``mini_batch_size="auto"`` probe measures too): the inner peak counts toward the outer one.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from st_ext._compat import profiler_cpu_memory_events

if TYPE_CHECKING:
    from torch.profiler import profile

CUDA_METER = "torch.cuda.max_memory_allocated"
CPU_METER = "torch.profiler allocation events"


@dataclass
class PeakMemory:
    """What :func:`measure_peak` found; filled in when the block exits."""

    device: torch.device
    meter: str
    peak_bytes: int = 0
    #: Allocated on exit, above the level on entry: what the block leaves alive.
    end_bytes: int = 0

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / 2**20

    def __str__(self) -> str:
        return f"{self.peak_mib:.1f} MiB peak on {self.device} ({self.meter})"


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """The device to measure: the given one, else CUDA when present, else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@contextlib.contextmanager
def measure_peak(device: str | torch.device | None = None) -> Iterator[PeakMemory]:
    """Measure the peak tensor memory allocated on ``device`` inside the ``with`` block.

    >>> with measure_peak("cpu") as mem:
    ...     x = torch.empty(2**20, dtype=torch.uint8)
    >>> mem.peak_bytes >= 2**20
    True
    """
    device = resolve_device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"measure_peak supports 'cpu' and 'cuda' devices, got {device}.")
    with (_measure_cuda if device.type == "cuda" else _measure_cpu)(device) as result:
        yield result


@dataclass
class _CudaWindow:
    baseline: int
    peak: int = 0

    def fold(self, device: torch.device) -> None:
        """Take the allocator's peak since the last reset, before a nested window resets it."""
        self.peak = max(self.peak, torch.cuda.max_memory_allocated(device) - self.baseline)


#: Open CUDA measurements per device, innermost last.
_CUDA_WINDOWS: dict[torch.device, list[_CudaWindow]] = {}


@contextlib.contextmanager
def _measure_cuda(device: torch.device) -> Iterator[PeakMemory]:
    result = PeakMemory(device=device, meter=CUDA_METER)
    torch.cuda.synchronize(device)
    windows = _CUDA_WINDOWS.setdefault(device, [])
    if windows:
        windows[-1].fold(device)
    window = _CudaWindow(baseline=torch.cuda.memory_allocated(device))
    windows.append(window)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        yield result
    finally:
        torch.cuda.synchronize(device)
        result.end_bytes = max(0, torch.cuda.memory_allocated(device) - window.baseline)
        window.fold(device)
        windows.pop()
        if windows:  # the enclosing window saw this one's peak, on top of the level this one started at
            outer = windows[-1]
            outer.peak = max(outer.peak, window.peak + window.baseline - outer.baseline)
        result.peak_bytes = max(0, window.peak)


class _CpuWindow:
    """One CPU measurement's allocation events, over the profiler runs it spans (only one profiler can
    run at a time: a nested measurement stops this one's, runs its own, and hands its events back)."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []
        self._profiler: profile | None = None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profiler = profiler
        with _native_stderr_silenced():
            profiler.start()

    def stop(self) -> None:
        profiler = self._profiler
        assert profiler is not None, "stop() follows start()"
        with _native_stderr_silenced():
            profiler.stop()
        self.events += profiler_cpu_memory_events(profiler)
        self._profiler = None


#: Open CPU measurements, innermost last.
_CPU_WINDOWS: list[_CpuWindow] = []


@contextlib.contextmanager
def _measure_cpu(device: torch.device) -> Iterator[PeakMemory]:
    result = PeakMemory(device=device, meter=CPU_METER)
    if _CPU_WINDOWS:
        _CPU_WINDOWS[-1].stop()
    window = _CpuWindow()
    _CPU_WINDOWS.append(window)
    window.start()
    try:
        yield result
    finally:
        window.stop()
        _CPU_WINDOWS.pop()
        if _CPU_WINDOWS:
            outer = _CPU_WINDOWS[-1]
            outer.events += window.events
            outer.start()
        result.peak_bytes, result.end_bytes = replay_allocation_events(window.events)


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """The profiler's C++ side writes two lines per window to file descriptor 2 ("USDT ...
    profiler_start/stop", a warning about blocks allocated before the window): by the dozen in a run."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real descriptor 2 (an embedded interpreter)
        yield
        return
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def replay_allocation_events(events: list[tuple[int, int]]) -> tuple[int, int]:
    """Highest total of the blocks allocated inside the window and alive together, and the total of those
    still alive at its end.

    A free counts only while a block of its size allocated inside the window is alive: the profiler
    also reports frees of blocks allocated during an earlier profiled window, which would otherwise
    make room for the block's own allocations and hide them.
    """
    alive_sizes: Counter[int] = Counter()
    running = peak = 0
    for _, nbytes in sorted(events):
        if nbytes >= 0:
            alive_sizes[nbytes] += 1
        elif alive_sizes[-nbytes]:
            alive_sizes[-nbytes] -= 1
        else:
            continue
        running += nbytes
        peak = max(peak, running)
    return peak, running
