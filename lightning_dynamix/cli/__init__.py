"""The ``dynamix`` command: demo, benchmarks."""
