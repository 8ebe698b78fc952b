"""`python -m service.cli`: the `csd` command."""

import sys

from service.cli.main import main

sys.exit(main())
