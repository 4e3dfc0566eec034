"""The tree passes the project's lint rules (pyproject.toml's [tool.ruff]: 110 columns, import order,
pyflakes, bugbear, pyupgrade), so the README's test command enforces them where CI runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    pytest.importorskip("ruff", reason="ruff comes with the test extras (pip install -e '.[test]')")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"ruff check found problems:\n{done.stdout[-4000:]}{done.stderr[-2000:]}"
