"""The version of asyncckpt: the one place the number is written (pyproject.toml reads it)."""

__version__ = "0.1.0"
