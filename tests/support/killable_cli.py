"""`deepinfer-job` with the test-only kill hooks installed (tests/support/kill_hooks.py), for chaos tests
that SIGKILL a submit at a named point of the commit protocol: ``python -m tests.support.killable_cli``."""

from __future__ import annotations

import sys

from deepinfer.pipeline.cli.main import main

from tests.support.kill_hooks import install_from_env

if __name__ == "__main__":
    install_from_env()
    sys.exit(main())
