"""`python -m deepinfer.pipeline.cli` runs the `deepinfer-job` command."""

import sys

from deepinfer.pipeline.cli.main import main

sys.exit(main())
