"""The version of multiwrite: written here once (pyproject.toml reads it; `multiwrite.__version__` re-exports it)."""

__version__ = "0.4.0"
