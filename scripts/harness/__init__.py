"""The runner as a library: plans, the shared-prefill grid loop, the result store and its records."""
