"""``python -m tools.gpu_check``: see :mod:`tools.gpu_check.cli`."""

import sys

from tools.gpu_check.cli import main

sys.exit(main())
