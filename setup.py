"""Package layout, declared once: each source folder is installed as `deepinfer.<folder>`.

`deepinfer` itself is a namespace package (no __init__.py); every subfolder with an __init__.py under a
source root is found here, so adding one needs no edit (tests/test_packaging.py checks both an editable
and a wheel install). Everything else about the project is in pyproject.toml.
"""

from setuptools import find_packages, setup

SOURCE_ROOTS = ("engine", "kernels", "pipeline", "schemas")

setup(
    package_dir={f"deepinfer.{root}": root for root in SOURCE_ROOTS},
    packages=[
        f"deepinfer.{root}" + (f".{sub}" if sub else "")
        for root in SOURCE_ROOTS
        for sub in ["", *find_packages(root)]
    ],
)
