"""`deepinfer-job` with the test-only kill hooks installed (tests/support/kill_hooks.py), for chaos tests
that SIGKILL a submit at a named point of the commit protocol, or pause it there to signal it mid-run:
``python -m tests.support.killable_cli``. With ``DEEPINFER_TEST_NUMERICS`` set, its in-process engines
report that numerics stack instead of this machine's (a resume "on another machine").

It also runs the submit as a terminal's foreground job would, with Ctrl-C's default handler: a test
runner started in the background by a non-interactive shell (`cmd &`) hands its children an ignored
SIGINT, which deepinfer-job deliberately keeps ignored (pipeline/cli/main.py), so a SIGINT test would
otherwise depend on how the suite was launched."""

from __future__ import annotations

import os
import signal
import sys

from deepinfer.pipeline.cli.main import main

from tests.support.kill_hooks import install_from_env

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    install_from_env()
    if os.environ.get("DEEPINFER_TEST_NUMERICS"):
        from deepinfer.engine.llm import LLM

        stack = os.environ["DEEPINFER_TEST_NUMERICS"]
        LLM.numerics_stack = property(lambda self: stack)  # type: ignore[method-assign,assignment]
    sys.exit(main())
