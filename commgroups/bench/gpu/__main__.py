"""``python -m commgroups.bench.gpu``: see :mod:`commgroups.bench.gpu.cli`."""

import sys

from commgroups.bench.gpu.cli import main

sys.exit(main())
