"""One format for every log line the service writes: a timestamp first (local time with milliseconds, as
logging's default `asctime`), so a log read after the fact says when a start, a shutdown or an error happened
and how long the steps between took. uvicorn's lines (access log included) get the same timestamp."""

from __future__ import annotations

import copy
import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_root(level: str) -> None:
    """The root logger (our `service` and `ocm_store` loggers, libraries) with timestamps."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


def uvicorn_log_config() -> dict:
    """uvicorn's own logging config with the timestamp in front of each of its formats."""
    import uvicorn.config

    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    for formatter in config["formatters"].values():
        formatter["fmt"] = "%(asctime)s " + formatter["fmt"]
    return config
