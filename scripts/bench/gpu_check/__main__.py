"""``python -m scripts.bench.gpu_check``: ``scripts.bench.gpu_check.cli.main``."""

import sys

from scripts.bench.gpu_check.cli import main

sys.exit(main())
