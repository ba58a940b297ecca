from __future__ import annotations

import sys

from st_ext.cli import main

sys.exit(main())
