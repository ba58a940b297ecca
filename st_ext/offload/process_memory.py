"""This process's memory: reading it, and handing freed memory back to the system so that a
release shows in the readings."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

CPU_MEMORY_METER = "process RSS, /proc/self/statm"
CUDA_MEMORY_METER = "torch.cuda.memory_allocated"


@dataclass(frozen=True)
class MemoryReading:
    """One meter's reading; ``bytes`` is None where the meter is not available."""

    device: str
    meter: str
    bytes: int | None

    def __str__(self) -> str:
        shown = "n/a" if self.bytes is None else format_bytes(self.bytes)
        return f"{self.device} ({self.meter}): {shown}"


def process_rss_bytes() -> int | None:
    """Resident set size of this process (anonymous and file-backed pages), Linux only."""
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def read_memory(devices: Iterable[str] = ()) -> list[MemoryReading]:
    """Process RSS, plus ``torch.cuda.memory_allocated`` of each CUDA device in ``devices``."""
    readings = [MemoryReading("cpu", CPU_MEMORY_METER, process_rss_bytes())]
    for device in sorted(set(devices)):
        if device.startswith("cuda"):
            readings.append(MemoryReading(device, CUDA_MEMORY_METER, torch.cuda.memory_allocated(device)))
    return readings


def format_bytes(count: int) -> str:
    """``1536`` → ``"1.5 KiB"``: leftovers range from a bias to a whole embedding matrix."""
    size: float = count
    for unit in ("B", "KiB", "MiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.2f} GiB"


def return_freed_memory() -> None:
    """Collect reference cycles, hand cached CUDA blocks back, and trim the C heap.

    glibc keeps freed heap pages for reuse, so without ``malloc_trim(0)`` RSS would not drop.
    """
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    trim = glibc_malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def glibc_malloc_trim() -> Any:
    """glibc's ``malloc_trim`` through ctypes, or None off Linux / on another C library."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
