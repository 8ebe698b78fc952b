"""`csd serve`: the OpenAI-compatible HTTP service, and its flags."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import get_args

from service.cli.common import (
    LOG_LEVELS,
    CLIError,
    add_engine_options,
    json_list,
    quiet_libraries,
    settings_from_args,
)


def add_parser(sub) -> None:
    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP service")
    g = srv.add_argument_group("HTTP service (default from CSD_* environment variables)")
    g.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, help="port to listen on (default 8000; 0: any free port)")
    g.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        metavar="KEY",
        help="accepted Bearer key (repeatable; prefer CSD_API_KEYS=k1,k2: flags show up in ps)",
    )
    g.add_argument("--served-model-name", help="model id shown by the API (default: the model's name)")
    g.add_argument("--max-queue", type=int, help="requests waiting beyond the running batch; more get 429")
    g.add_argument("--max-batch-size", type=int, help="generations sharing each target forward")
    g.add_argument(
        "--max-batched-tokens", type=int, help="tokens in one target forward (also the prefill chunk)"
    )
    g.add_argument("--max-tokens-cap", type=int, help="largest max_tokens a request may ask for")
    g.add_argument("--default-max-tokens", type=int, help="max_tokens of requests that send none")
    g.add_argument("--default-temperature", type=float, help="temperature of requests that send none (0)")
    g.add_argument("--request-timeout", dest="request_timeout_s", type=float, metavar="SECONDS")
    g.add_argument("--max-body-bytes", type=int, help="largest request body; larger gets 413")
    g.add_argument(
        "--body-timeout", dest="body_timeout_s", type=float, metavar="SECONDS", help="slower bodies get 408"
    )
    g.add_argument(
        "--shutdown-grace", dest="shutdown_grace_s", type=float, metavar="SECONDS", help="to drain on SIGTERM"
    )
    g.add_argument(
        "--responses-store-size",
        type=int,
        help="responses kept for previous_response_id (default 512; 0: none)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="reuse the KV cache of prompts' shared beginnings (default: on where the model allows it)",
    )
    g.add_argument(
        "--prefix-cache-gib", type=float, metavar="GIB", help="prefix cache bound (default: 10%% of memory)"
    )
    g.add_argument(
        "--record-traffic",
        type=Path,
        metavar="DIR",
        help="record served token ids (never text) to DIR for `python -m training --from-traffic DIR` "
        "(default: off; CSD_RECORD_TRAFFIC)",
    )
    g.add_argument(
        "--record-traffic-max-bytes", type=int, metavar="BYTES", help="recording stops at this size (1 GiB)"
    )
    g.add_argument("--log-level", choices=LOG_LEVELS, help="default: CSD_LOG_LEVEL, or info")
    from service.config import ToolCallParserName

    g.add_argument(
        "--tool-call-parser",
        choices=list(get_args(ToolCallParserName)),
        help="how tool_choice 'auto' reads tool calls from the model's text (default: hermes)",
    )
    cors = srv.add_argument_group("CORS: browser pages on other origins (off unless --allowed-origins)")
    cors.add_argument(
        "--allowed-origins",
        type=json_list,
        metavar="JSON",
        help='e.g. \'["https://app.example"]\'; ["*"]: any',
    )
    cors.add_argument("--allowed-methods", type=json_list, metavar="JSON", help='default ["*"]')
    cors.add_argument("--allowed-headers", type=json_list, metavar="JSON", help='default ["*"]')
    cors.add_argument(
        "--allow-credentials", action="store_true", default=None, help="allow cookies and credentials"
    )
    add_engine_options(srv)
    srv.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    quiet_libraries()
    from service.api.server import bind_socket, serve

    log_level = args.log_level or os.environ.get("CSD_LOG_LEVEL", "info").lower()
    # Our own loggers follow --log-level too (the root logger stays at CSD_LOG_LEVEL for libraries).
    for name in ("service", "ocm_store"):
        logging.getLogger(name).setLevel(log_level.upper())
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        raise CLIError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}") from None
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    auth = f"{len(settings.api_keys)} API key(s)" if settings.api_keys else "no API keys"
    print(
        f"csd: serving {settings.model} on http://{shown}:{port} ({auth}); loading the model, "
        "GET /ready answers 200 once it generates",
        file=sys.stderr,
        flush=True,
    )
    error = serve(settings, log_level=log_level, sock=sock)
    if error is not None:
        raise CLIError(f"cannot start: {error}")
    return 0
