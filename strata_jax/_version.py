"""The package version (pyproject.toml has the same): imported by the layers that report it."""

__version__ = "0.1.0"
