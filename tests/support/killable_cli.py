"""`deepinfer-job` with the test-only kill hooks installed (tests/support/kill_hooks.py), for chaos tests
that SIGKILL a submit at a named point of the commit protocol, or pause it there to signal it mid-run:
``python -m tests.support.killable_cli``.

It also runs the submit as a terminal's foreground job would, with Ctrl-C's default handler: a test
runner started in the background by a non-interactive shell (`cmd &`) hands its children an ignored
SIGINT, which deepinfer-job deliberately keeps ignored (pipeline/cli/main.py), so a SIGINT test would
otherwise depend on how the suite was launched."""

from __future__ import annotations

import signal
import sys

from deepinfer.pipeline.cli.main import main

from tests.support.kill_hooks import install_from_env

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    install_from_env()
    sys.exit(main())
