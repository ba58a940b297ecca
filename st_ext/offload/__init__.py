"""Offload and release of frozen encoders (a GIST guide, a distillation teacher), with a check.

- :func:`offload` / :func:`onload` move a frozen module off the accelerator (to CPU) and back;
  :func:`on_device` brings it onto a device for a ``with`` block and puts every tensor back after.
- :func:`release` frees it for good and returns a :class:`ReleaseReport`; a released module raises
  :class:`ReleasedModuleError` when used.
- :func:`leftovers` / :func:`assert_released` name every tensor still alive and what holds it.
- :func:`precompute_embeddings` encodes dataset columns once, then may release the encoder.

A module being trained is refused (:class:`TrainableModuleError`) unless ``force=True``.
Modules, lowest first: ``process_memory``, ``records``, ``guards``, ``placement``,
``leftover_check``, ``releasing``, ``precompute``.
"""

from __future__ import annotations

from st_ext.offload.guards import (
    DispatchedModuleError,
    LeftoverError,
    OffloadError,
    ReleasedModuleError,
    TrainableModuleError,
    is_released,
    refuse_if_released,
    refuse_if_trainable,
    remove_release_guard,
)
from st_ext.offload.leftover_check import assert_released, leftovers
from st_ext.offload.placement import offload, on_device, onload
from st_ext.offload.precompute import (
    GUIDE_EMBEDDING_COLUMN_TEMPLATE,
    embedding_column_name,
    precompute_embeddings,
)
from st_ext.offload.process_memory import (
    CPU_MEMORY_METER,
    CUDA_MEMORY_METER,
    MemoryReading,
    format_bytes,
    process_rss_bytes,
    read_memory,
)
from st_ext.offload.records import (
    Leftover,
    LeftoverReport,
    ReleaseRecord,
    ReleaseReport,
    describe_module,
    name_or_path_of,
)
from st_ext.offload.releasing import release

__all__ = [
    "CPU_MEMORY_METER",
    "CUDA_MEMORY_METER",
    "GUIDE_EMBEDDING_COLUMN_TEMPLATE",
    "DispatchedModuleError",
    "Leftover",
    "LeftoverError",
    "LeftoverReport",
    "MemoryReading",
    "OffloadError",
    "ReleaseRecord",
    "ReleaseReport",
    "ReleasedModuleError",
    "TrainableModuleError",
    "assert_released",
    "describe_module",
    "embedding_column_name",
    "format_bytes",
    "is_released",
    "leftovers",
    "name_or_path_of",
    "offload",
    "on_device",
    "onload",
    "precompute_embeddings",
    "process_rss_bytes",
    "read_memory",
    "refuse_if_released",
    "refuse_if_trainable",
    "release",
    "remove_release_guard",
]
