"""`python -m pipeline`: the `pipeline` command (pipeline/entrypoints/cli.py), as torchrun, the launcher and the
supervisor start it."""

import sys

from pipeline.entrypoints.cli import main

sys.exit(main())
