"""`python -m deepinfer.pipeline.cli` runs the `deepinfer-job` command (see main.console_main)."""

from deepinfer.pipeline.cli.main import console_main

console_main()
