"""The exceptions of st_ext.offload, in one place so that every step can raise them.

Callers catch :class:`OffloadError` for any refusal; :class:`LeftoverError` is an
``AssertionError`` because :func:`~st_ext.offload.assert_released` is meant for tests.
"""

from __future__ import annotations


class OffloadError(RuntimeError):
    """Base class of the errors st_ext.offload raises."""


class TrainableModuleError(OffloadError):
    """The module is being trained; moving or releasing it would break training."""


class ReleasedModuleError(OffloadError):
    """The module was released: its weights are gone and it cannot run."""


class DispatchedModuleError(OffloadError):
    """accelerate owns the module's weights (cpu/disk offload), so they cannot be moved here."""


class LeftoverError(AssertionError):
    """Something of a released module is still alive; raised by :func:`assert_released`."""
