"""A module's tensors by name, and the records and reports a release makes of them.

:class:`ReleaseRecord` is taken before a release (weak references only), :class:`LeftoverReport` is
the leftover check's result and :class:`ReleaseReport` the release's.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from st_ext._compat import own_buffers, own_parameters, recorded_name_or_path
from st_ext.offload.process_memory import MemoryReading, format_bytes, read_memory

#: Only this many leftovers are traced (one heap scan per step) and listed in full.
TRACED_LEFTOVERS_LIMIT = 12


def named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter, buffer and plain tensor attribute of the tree, tied ones under each name."""
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        dotted = f"{prefix}." if prefix else ""
        for registry in (own_parameters(submodule), own_buffers(submodule), vars(submodule)):
            for name, value in registry.items():
                if isinstance(value, torch.Tensor):
                    yield dotted + name, value


def tensor_kind(module: nn.Module, name: str) -> str:
    """``"parameter"``, ``"buffer"`` or ``"tensor attribute"``: what ``name`` is in ``module``."""
    owner_name, _, attribute = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if attribute in own_parameters(owner):
        return "parameter"
    if attribute in own_buffers(owner):
        return "buffer"
    return "tensor attribute"


def storage_key(tensor: torch.Tensor) -> tuple[str, int] | None:
    """(device, address) of the tensor's memory, by which views and saved copies are matched."""
    try:
        storage = tensor.untyped_storage()
        return (str(tensor.device), storage.data_ptr()) if storage.nbytes() else None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def name_or_path_of(module: nn.Module) -> str | None:
    """Where the module was loaded from, if a Hugging Face model inside recorded it."""
    for submodule in module.modules():
        for candidate in (
            getattr(submodule, "name_or_path", None),
            recorded_name_or_path(getattr(submodule, "config", None)),
        ):
            if isinstance(candidate, str) and candidate:
                return candidate
    return None


def describe_module(module: nn.Module) -> str:
    """``SentenceTransformer('/path/to/model')``, or the class name when the path is unknown."""
    path = name_or_path_of(module)
    return f"{type(module).__name__}({path!r})" if path else type(module).__name__


def first_names(names: Sequence[str]) -> str:
    return ", ".join(repr(name) for name in names[:3]) + (", ..." if len(names) > 3 else "")


@dataclass
class TrackedTensor:
    """One tensor of a module about to be released, known without keeping it alive.

    Its storage is watched too: a view, ``.detach()`` or ``.data`` keeps the memory but not the tensor.
    """

    name: str
    aliases: list[str]
    kind: str
    nbytes: int
    device: str
    tensor_ref: weakref.ref
    storage_ref: weakref.ref | None
    storage_key: tuple[str, int] | None


@dataclass
class ReleaseRecord:
    """Weak references and sizes of a module's tensors, taken just before :func:`release`."""

    description: str
    reload_hint: str
    tracked: list[TrackedTensor]
    memory_before: list[MemoryReading]
    module_ref: weakref.ref
    guard_handles: list[Any] = field(default_factory=list)

    @classmethod
    def of(cls, module: nn.Module) -> ReleaseRecord:
        """Weak references to every distinct tensor of ``module`` not on ``meta``, and the memory now."""
        by_id: dict[int, TrackedTensor] = {}
        for name, tensor in named_tensors(module):
            if id(tensor) in by_id:
                by_id[id(tensor)].aliases.append(name)
                continue
            try:
                storage_ref = weakref.ref(tensor.untyped_storage())
            except (RuntimeError, NotImplementedError, TypeError):
                storage_ref = None
            by_id[id(tensor)] = TrackedTensor(
                name=name,
                aliases=[],
                kind=tensor_kind(module, name),
                nbytes=tensor.numel() * tensor.element_size(),
                device=str(tensor.device),
                tensor_ref=weakref.ref(tensor),
                storage_ref=storage_ref,
                storage_key=storage_key(tensor),
            )
        tracked = [entry for entry in by_id.values() if entry.device != "meta"]
        path = name_or_path_of(module)
        if path is None:
            hint = "Load it again from where it came from to use it (no name_or_path was recorded on it)."
        else:
            loader = type(module).__name__ + (".from_pretrained" if hasattr(type(module), "from_pretrained") else "")
            hint = f"Load it again to use it: {loader}({path!r})."
        memory_before = read_memory({entry.device for entry in tracked})
        return cls(describe_module(module), hint, tracked, memory_before, weakref.ref(module))

    @property
    def tensor_bytes(self) -> int:
        return sum(entry.nbytes for entry in self.tracked)

    @property
    def devices(self) -> set[str]:
        return {entry.device for entry in self.tracked}

    def released_message(self) -> str:
        return (
            f"{self.description} was released by st_ext.offload.release(): its parameters and buffers "
            f"are 'meta' placeholders and its weights were freed, so it cannot run. {self.reload_hint}"
        )


@dataclass
class Leftover:
    """One tensor of a released module that is still alive, and what holds it."""

    name: str
    kind: str
    nbytes: int
    device: str
    how: str
    held_by: list[str]

    def __str__(self) -> str:
        holders = "; ".join(self.held_by) if self.held_by else "not traced"
        return (
            f"{self.kind} {self.name!r} ({format_bytes(self.nbytes)}, {self.device}): {self.how}\n"
            f"      held by: {holders}"
        )


@dataclass
class LeftoverReport:
    """Result of :func:`leftovers`: every tensor of the released module still alive, by name."""

    description: str
    tensor_count: int
    tensor_bytes: int
    leftovers: list[Leftover]
    memory_before: list[MemoryReading]
    memory_after: list[MemoryReading]

    @property
    def ok(self) -> bool:
        return not self.leftovers

    @property
    def leftover_names(self) -> list[str]:
        return [leftover.name for leftover in self.leftovers]

    @property
    def leftover_bytes(self) -> int:
        return sum(leftover.nbytes for leftover in self.leftovers)

    def __str__(self) -> str:
        size = f"{self.tensor_count} tensors, {format_bytes(self.tensor_bytes)}"
        if self.ok:
            lines = [f"{self.description} is fully released ({size}): no parameter or buffer is alive."]
        else:
            lines = [
                f"{self.description}: {len(self.leftovers)} of {self.tensor_count} tensors still alive "
                f"({format_bytes(self.leftover_bytes)} of {format_bytes(self.tensor_bytes)})."
            ]
        for before, after in zip(self.memory_before, self.memory_after):
            meter = f"  memory {before.device} ({before.meter}): "
            if before.bytes is None or after.bytes is None:
                lines.append(meter + "n/a")
                continue
            change = after.bytes - before.bytes
            lines.append(
                f"{meter}{format_bytes(before.bytes)} -> {format_bytes(after.bytes)} "
                f"({'+' if change >= 0 else '-'}{format_bytes(abs(change))})"
            )
        shown, rest = self.leftovers[:TRACED_LEFTOVERS_LIMIT], self.leftovers[TRACED_LEFTOVERS_LIMIT:]
        lines += [f"  - {leftover}" for leftover in shown]
        if rest:
            lines.append(f"  - {len(rest)} more: {', '.join(leftover.name for leftover in rest)}")
        return "\n".join(lines)


@dataclass
class ReleaseReport:
    """Result of :func:`release`: what was cleared, and the leftover check run right after it."""

    record: ReleaseRecord
    cleared: list[str]
    module_hooks_removed: int
    accelerate_hooks_removed: bool
    malloc_trimmed: bool
    check: LeftoverReport | None

    @property
    def ok(self) -> bool:
        return self.check is None or self.check.ok

    def __str__(self) -> str:
        lines = [
            f"Released {self.record.description}: {len(self.record.tracked)} tensors, "
            f"{format_bytes(self.record.tensor_bytes)}.",
            f"  cleared references: {', '.join(self.cleared) if self.cleared else 'none'}",
            f"  module hooks removed: {self.module_hooks_removed}; accelerate hooks removed: "
            f"{'yes' if self.accelerate_hooks_removed else 'none present'}; "
            f"malloc_trim: {'done' if self.malloc_trimmed else 'not available'}",
        ]
        if self.check is not None:
            lines += ["  " + line for line in str(self.check).splitlines()]
        return "\n".join(lines)
