"""deepinfer's test suite (a package, so test modules can share helpers through relative imports).

While the tests run, the repository root is on sys.path (pytest puts it there for this package), and with
it deepinfer's source folders as top-level names: `kernels` among them. transformers >= 5.25 depends on
Hugging Face's `kernels` package and imports it when it is installed (`from kernels import ...` when
transformers.integrations loads), which then found deepinfer's kernels/ folder and failed. This package is
imported before any test module, in every process that runs tests (the interpreter batch too), so it
imports the installed `kernels` first, with the repository root out of the way: later imports of the name
get Hugging Face's package from sys.modules. deepinfer itself only ever imports `deepinfer.kernels`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _import_installed_kernels() -> None:
    root = Path(__file__).resolve().parent.parent

    def is_root(entry: str) -> bool:
        try:
            return Path(entry or ".").resolve() == root
        except OSError:
            return False

    if "kernels" in sys.modules:
        return
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if not is_root(p)]
    try:
        if importlib.util.find_spec("kernels") is not None:
            import kernels  # noqa: F401  (Hugging Face's, kept in sys.modules)
    except ImportError:
        pass   # not installed, or broken: transformers then does not use it either
    finally:
        sys.path[:] = saved


_import_installed_kernels()
