"""The records and reports of a release: plain data, with the text shown to users.

:class:`ReleaseRecord` is taken before a release (weak references only), :class:`LeftoverReport`
is the result of the leftover check and :class:`ReleaseReport` the result of a release.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from st_ext.offload.process_memory import MemoryReading, format_bytes

_TRACED_LEFTOVERS_LIMIT = 12


@dataclass
class _TrackedTensor:
    """What is known, without keeping it alive, about one tensor of a module before release."""

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
    """Weak references and sizes of a module's tensors, taken just before :func:`release`.

    Holds no strong reference to the module or its tensors, so keeping it costs nothing.
    """

    description: str
    reload_hint: str
    tracked: list[_TrackedTensor]
    memory_before: list[MemoryReading]
    module_ref: weakref.ref
    guard_handles: list[Any] = field(default_factory=list)

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

    def memory_change_lines(self) -> list[str]:
        lines = []
        for before, after in zip(self.memory_before, self.memory_after):
            if before.bytes is None or after.bytes is None:
                lines.append(f"{before.device} ({before.meter}): n/a")
                continue
            change = after.bytes - before.bytes
            lines.append(
                f"{before.device} ({before.meter}): {format_bytes(before.bytes)} -> "
                f"{format_bytes(after.bytes)} ({'+' if change >= 0 else '-'}{format_bytes(abs(change))})"
            )
        return lines

    def __str__(self) -> str:
        size = f"{self.tensor_count} tensors, {format_bytes(self.tensor_bytes)}"
        if self.ok:
            head = f"{self.description} is fully released ({size}): no parameter or buffer is alive."
        else:
            head = (
                f"{self.description}: {len(self.leftovers)} of {self.tensor_count} tensors still alive "
                f"({format_bytes(self.leftover_bytes)} of {format_bytes(self.tensor_bytes)})."
            )
        lines = [head] + [f"  memory {line}" for line in self.memory_change_lines()]
        shown, rest = self.leftovers[:_TRACED_LEFTOVERS_LIMIT], self.leftovers[_TRACED_LEFTOVERS_LIMIT:]
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
