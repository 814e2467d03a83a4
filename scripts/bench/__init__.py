"""The benchmarks and measurement tools, each a command (``python -m scripts.bench.<name>``)."""
