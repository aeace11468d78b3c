"""The package's version, in one place: ``pyproject.toml`` reads it (setuptools' ``attr:``), the package exports it
and dump manifests record it."""

__version__ = "0.1.0"
