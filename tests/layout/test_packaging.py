"""The package is declared once: every source folder is part of the installed package (editable and wheel),
including a folder added later with no edit of pyproject.toml or setup.py."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("engine", "kernels", "pipeline", "schemas")


def _python_folders(root: Path) -> list[Path]:
    return sorted({p.parent for r in SOURCE_ROOTS for p in (root / r).rglob("*.py")
                   if "__pycache__" not in p.parts})


def _dotted(folder: Path, root: Path) -> str:
    return ".".join(["deepinfer", *folder.relative_to(root).parts])


def test_every_python_folder_is_a_package_with_an_init():
    missing = [str(f.relative_to(REPO)) for f in _python_folders(REPO) if not (f / "__init__.py").is_file()]
    assert missing == []


@pytest.mark.parametrize("folder", [str(f.relative_to(REPO)) for f in _python_folders(REPO)])
def test_every_python_folder_imports_from_the_installed_package(folder):
    module = importlib.import_module(_dotted(REPO / folder, REPO))
    assert Path(module.__file__).resolve().parent == (REPO / folder).resolve()


def _build_wheel(src: Path, out: Path) -> zipfile.ZipFile:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
         str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("deepinfer-*.whl")
    return zipfile.ZipFile(wheel)


@pytest.fixture(scope="module")
def tree_with_a_new_room(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the source tree with a brand-new subpackage that no packaging file mentions."""
    root = tmp_path_factory.mktemp("src") / "deepinfer"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist", ".git", "out", "tests")
    for name in (*SOURCE_ROOTS, "pyproject.toml", "setup.py", "README.md"):
        src = REPO / name
        (shutil.copytree(src, root / name, ignore=ignore) if src.is_dir() else shutil.copy(src, root / name))
    new = root / "engine" / "brand_new_room" / "deeper"
    new.mkdir(parents=True)
    for d in (new.parent, new):
        (d / "__init__.py").write_text('"""A room added after the packaging files were written."""\n')
    (new / "thing.py").write_text("VALUE = 42\n")
    return root


def test_a_wheel_holds_every_module_package_data_and_a_new_room(tree_with_a_new_room, tmp_path):
    root = tree_with_a_new_room
    names = set(_build_wheel(root, tmp_path).namelist())
    expected = {"deepinfer/" + str(p.relative_to(root)) for r in SOURCE_ROOTS
                for p in (root / r).rglob("*.py") if "__pycache__" not in p.parts}
    assert expected - names == set()
    assert "deepinfer/engine/brand_new_room/deeper/thing.py" in names
    assert {"deepinfer/schemas/job.schema.json", "deepinfer/schemas/summary.schema.json",
            "deepinfer/engine/models/data/demo_corpus.txt"} <= names
    assert not any(n.startswith(("deepinfer/tests/", "tests/", "benchmarks/")) for n in names)
