"""deepinfer's version, read from the installed distribution's metadata (defined once, in pyproject.toml)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("deepinfer")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
