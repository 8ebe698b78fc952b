"""`csd`: the command-line tool (generate, calibrate, ocm, serve), one module per command.

| module | what |
|---|---|
| `main.py` | the parser of every command, and `main`: the entry point (`csd`, `python -m service.cli`) |
| `common.py` | what the commands share: `CLIError`, the model and speculation flags, the flags as `Settings`, building the runtime |
| `generate.py` | `csd generate`: one generation, its text and acceptance statistics |
| `calibrate.py` | `csd calibrate`: warm the OCM over in-domain prompts |
| `serve.py` | `csd serve`: the HTTP service and its flags |
| `ocm.py` | `csd ocm`: inspect and manage the Online Correction Memory |

Every failure a user can cause (a bad flag value, a missing model, a wrong file) ends in one line
`csd: error: ...` and exit status 2, never a traceback. Importing the package loads no torch: bad arguments
are refused before the slow imports (tests/test_layering.py).
"""  # noqa: E501

from __future__ import annotations

from service.cli.common import EXIT_USAGE, CLIError, settings_from_args
from service.cli.main import build_parser, main

__all__ = ["EXIT_USAGE", "CLIError", "build_parser", "main", "settings_from_args"]
