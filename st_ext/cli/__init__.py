"""``st-ext``, the command-line job: :mod:`.main` (the command and its parser), :mod:`.job` (the
training run), :mod:`.demo_data`, :mod:`.evaluation` and :mod:`.reporting`.

``main`` is the console script ``st-ext`` (``st_ext.cli:main``) and ``python -m st_ext``.
"""

from st_ext.cli.main import EXIT_BAD_INPUT, main

__all__ = ["EXIT_BAD_INPUT", "main"]
