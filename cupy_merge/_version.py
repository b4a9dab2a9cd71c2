"""The package version, importable without CuPy (the command line reads it)."""

__version__ = "0.4.0.dev0"
