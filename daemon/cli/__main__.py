"""`python -m specd.daemon.cli`: the `specd` command."""

import sys

from .main import main

sys.exit(main())
