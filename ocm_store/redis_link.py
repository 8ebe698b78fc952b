"""The store's link to Redis: connecting and reconnecting with exponential backoff, noting a lost link, the
background worker that flushes and refreshes off the hot path, and calling the Lua scripts by hash.

A link error (`_LINK_ERRORS`) marks the store disconnected and never reaches decoding; any other answer
from Redis is an error of one namespace (`_namespace_error`), which the others do not share.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import redis

from ocm_store.base import Namespace
from ocm_store.redis_local import _Local

# the store's one logger, named as before the split: log filters and tests select it by that name
log = logging.getLogger("ocm_store.redis_store")

# Connection-level failures: the link is gone (or not yet back); anything else is an answer from Redis.
_LINK_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


class LinkMixin:
    """A part of `RedisStore` (ocm_store.redis_store): its state is set up in `RedisStore.__init__`."""

    def _script(self, pipe, name: str, keys_: list[str], args: Sequence = ()) -> None:
        # execute_command, not pipe.evalsha: redis-py's cluster pipeline blocks the evalsha method (it cannot
        # know the keys are in one slot); the command itself is routed by its first key, and every script's
        # keys share the namespace's hash tag (keys.py).
        pipe.execute_command("EVALSHA", self._scripts[name][1], len(keys_), *keys_, *args)

    def _needs_scripts(self, results: list) -> bool:
        """True (after loading the scripts) when the server did not know them: run the pipeline again."""
        if not any(isinstance(r, redis.exceptions.NoScriptError) for r in results):
            return False
        for text, _sha in self._scripts.values():
            self._client.script_load(text)
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._io:
                if not self._connected and time.monotonic() >= self._next_attempt:
                    self._connect()
                if self._connected:
                    try:
                        self._flush_all()
                        if time.monotonic() >= self._next_refresh:
                            self._refresh(list(self._states))
                            self._next_refresh = time.monotonic() + self.refresh_interval_s
                    except _LINK_ERRORS as exc:
                        self._lost(exc)
                    except Exception:  # a bug must not kill the worker: log it and carry on
                        log.exception("OCM store: background worker error")
                connected = self._connected
            if connected:
                self._wake.wait(self.flush_interval_s)
                self._wake.clear()
            else:  # not the wake event: record() would spin us while nothing can be sent
                self._stop.wait(max(0.0, min(self._next_attempt - time.monotonic(), 1.0)))

    def _connect(self) -> None:
        try:
            self._client.ping()
        except redis.RedisError as exc:  # refused, timed out, wrong password, TLS failure ...
            self._lost(exc)
            return
        if self._ever_lost:
            self._reconnects += 1
            log.warning(
                "OCM store: reconnected to %s; sending %d buffered increments", self.url, self._buffered_total
            )
        else:
            log.info("OCM store: connected to %s", self.url)
        self._connected = True
        self._link_error = ""
        self._backoff = 0.0
        self._next_refresh = 0.0
        if self._ever_lost:  # perhaps another server now (a failover): check it holds what we saw
            with self._lock:
                for local in self._states.values():
                    local.verify = True

    def _lost(self, exc: BaseException) -> None:
        error = self._scrub(f"{type(exc).__name__}: {exc}")
        if self._connected or not self._ever_lost or error != self._link_error:
            log.warning(
                "OCM store: Redis at %s unavailable (%s); decoding goes on with the local view",
                self.url,
                error,
            )
        self._connected = False
        self._ever_lost = True
        self._link_error = error
        self._backoff = min(self.max_backoff_s, max(0.1, self._backoff * 2))
        self._next_attempt = time.monotonic() + self._backoff

    def _namespace_error(self, ns: Namespace, local: _Local, exc: Exception) -> None:
        error = self._scrub(str(exc))
        if error != local.error:
            log.error("OCM store: Redis refused namespace %s: %s", ns.key, error)
        local.error = error
        local.retry_at = time.monotonic() + self.max_backoff_s
