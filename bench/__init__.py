"""The benches: run each from the repository root as a module, ``python -m bench.<name>``."""
