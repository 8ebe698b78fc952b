"""Run the app under uvicorn: what `csd serve` does.

The CLI binds the socket itself, so a busy port is a one-line error (uvicorn would log and exit 1), and
hooks uvicorn's signal handling, so that /ready turns 503 the moment SIGTERM arrives while the requests
already running drain (up to shutdown_grace_s).
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn

from service.api.app import create_app
from service.config import Settings
from service.log_format import uvicorn_log_config


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket; raises OSError (address in use, unknown host, ...)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


# uvicorn cancels the tasks still running when its graceful-shutdown timeout ends: a stream is cut mid-write
# (no error event, no [DONE]) and the log shows a CancelledError traceback. So the app ends its requests
# itself when the grace ends (a 503, an SSE error event), and uvicorn's own timeout comes this much later,
# only for a task that is stuck beyond that.
END_MARGIN_S = 2.0


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app when a shutdown signal arrives (before connections drain) and when
    the shutdown grace is over (to end the requests still running)."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_signal: Callable[[], None],
        grace_s: float,
        on_grace_end: Callable[[], None],
    ) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self._grace_s = grace_s
        self._on_grace_end = on_grace_end

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_signal()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self._grace_s, self._on_grace_end)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


# Query parameters that carry credentials: a client that sends its key as `?api_key=` is refused (keys travel
# in the Authorization header), but the access log would still write the key down.
_CREDENTIAL_QUERY = re.compile(
    r"(?i)([?&](?:api[_-]?key|key|token|access[_-]?token|auth|authorization|password|secret)=)[^&\s\"']*"
)


def _redact(value: object) -> object:
    return _CREDENTIAL_QUERY.sub(r"\1[redacted]", value) if isinstance(value, str) else value


class RedactCredentials(logging.Filter):
    """Replaces the value of a credential query parameter by [redacted] in a log record's message and
    arguments (argument by argument: uvicorn's access formatter unpacks them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = _redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(_redact(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _redact(v) for k, v in record.args.items()}
        return True


def redact_credentials_in_logs() -> None:
    """Install the filter on every logger that may print a request's URL (uvicorn configures its loggers
    when its Config is built: call this afterwards)."""
    # A logger's filters see only the records logged to that very logger, not its children's
    # (service.api.worker, ...): the handlers that print them get the filter too.
    loggers = [logging.getLogger(name) for name in ("uvicorn.access", "uvicorn.error", "uvicorn", "service")]
    for target in [*loggers, *(h for logger in [*loggers, logging.getLogger()] for h in logger.handlers)]:
        if not any(isinstance(f, RedactCredentials) for f in target.filters):
            target.addFilter(RedactCredentials())


def serve(settings: Settings, log_level: str = "info", sock: socket.socket | None = None) -> str | None:
    """Serve until SIGINT/SIGTERM. Returns None after a clean shutdown, or the reason the model could not
    be loaded (the server stops by itself then)."""
    sock = sock or bind_socket(settings.host, settings.port)
    fatal: list[str] = []
    server: _Server | None = None

    def on_fatal(message: str) -> None:
        fatal.append(message)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_fatal=on_fatal)
    host, port = sock.getsockname()[:2]
    app.state.csd.address = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    config = uvicorn.Config(
        app,
        log_level=log_level,
        log_config=uvicorn_log_config(),
        lifespan="on",
        timeout_graceful_shutdown=settings.shutdown_grace_s + END_MARGIN_S,  # type: ignore[arg-type]
        server_header=False,
    )
    redact_credentials_in_logs()
    state = app.state.csd
    server = _Server(config, state.begin_shutdown, settings.shutdown_grace_s, state.end_generations)
    server.run(sockets=[sock])
    return fatal[0] if fatal else None
