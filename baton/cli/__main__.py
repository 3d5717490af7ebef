"""`python -m baton.cli ...`: the `baton` command (how local deployments start processes)."""

import sys

from baton.cli.main import main

sys.exit(main())
