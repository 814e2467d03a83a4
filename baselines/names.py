"""Method names as the command line spells them, without importing torch (baselines.md).

``run.py`` validates a configuration and prints ``--help`` from these names before it loads
torch; ``baselines/__init__.py`` builds the methods they name.
"""

BASE_METHODS = ("h2o", "tova", "snapkv", "adakv", "cam")
RESIDUAL_BASES = ("h2o", "tova", "snapkv", "adakv")
RESIDUAL_SUFFIX = "+reskv"
METHODS = ("full", *BASE_METHODS, *(base + RESIDUAL_SUFFIX for base in RESIDUAL_BASES))
