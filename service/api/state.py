"""The state of one running service: settings, metrics, the runtime once loaded, the engine worker, and
what readiness knows.

Life cycle: `start()` (from the lifespan) loads the runtime in a thread, so /health answers while the
models load; then the worker starts and a 1-token probe generation runs; /ready says 200 only once a real
generation has succeeded. `begin_shutdown()` (a signal, or the lifespan ending) turns /ready and new
requests to 503 while running requests drain; `stop()` cancels what is left and closes the store. An
engine that cannot go on (`EngineWorker.dead`) turns /health and /ready to 503 and calls `on_fatal`, which
stops the process (`csd serve` exits non-zero) so that its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ocm_store.base import StoreStatus
from service.api.errors import UNAVAILABLE, APIError, engine_dead, shutting_down
from service.api.events import DoneEvent, ErrorEvent, GenerationPlan, Job
from service.api.head_reload import HeadCollector, HeadReloads, reload_head
from service.api.metrics import OCMStoreCollector, ServiceMetrics
from service.api.worker import EngineWorker
from service.config import Settings
from service.decoding import DecodingError, Method, SamplingParams, SpeculativeConfig
from service.decoding.text import encode_prompt
from service.executor.paths import model_display_name
from service.runtime import Runtime
from service.traffic import TrafficCollector, TrafficRecorder

log = logging.getLogger(__name__)

PROBE_PROMPT = "Hello"


class ServiceState:
    def __init__(
        self,
        settings: Settings,
        runtime: Runtime | None = None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        # model_name as clients name the model (`Runtime.model_id`), known before the model loads
        self.metrics = ServiceMetrics(
            settings.num_speculative_tokens,
            model_name=settings.served_model_name or model_display_name(settings.model),
            max_batch_size=settings.max_batch_size,
            max_tokens=settings.max_tokens_cap,
        )
        self.metrics.registry.register(OCMStoreCollector(self.store_status, self.metrics.model_name))
        self.recorder: TrafficRecorder | None = None  # opt-in (settings.record_traffic)
        self.metrics.registry.register(TrafficCollector(lambda: self.recorder, self.metrics.model_name))
        self.head_reloads = HeadReloads()
        self.metrics.registry.register(
            HeadCollector(lambda: self.runtime, self.head_reloads, self.metrics.model_name)
        )
        self.runtime: Runtime | None = None
        self._given_runtime = runtime
        self.worker: EngineWorker | None = None
        self.on_fatal = on_fatal
        self.created = int(time.time())
        self.started = time.monotonic()
        self.address: str | None = None  # where clients reach us, set by `serve` once the socket is bound
        self._announced_ready = False
        self.load_error: str | None = None
        self.shutting_down = False
        self.last_forward_ok: float | None = None  # time.monotonic() of the last successful target forward
        self.probe_error: str | None = None
        self._probe_task: asyncio.Task[str | None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------ life cycle

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._given_runtime is not None:
            self._on_loaded(self._given_runtime, None)
            return
        # A daemon thread, not the loop's executor: a SIGTERM during a long model load must not wait for it.
        threading.Thread(target=self._load, name="csd-load", daemon=True).start()

    def _load(self) -> None:
        try:
            runtime, error = Runtime.build(self.settings), None
        except DecodingError as exc:
            runtime, error = None, str(exc)
        except Exception as exc:
            log.exception("loading the runtime failed")
            runtime, error = None, f"{type(exc).__name__}: {exc}"
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._on_loaded, runtime, error)
        except RuntimeError:  # the server stopped while we were loading
            if runtime is not None:
                runtime.close()

    def _on_loaded(self, runtime: Runtime | None, error: str | None) -> None:
        if error is not None or runtime is None:
            self.load_error = error or "unknown error"
            log.error("cannot start: %s", self.load_error)
            if self.on_fatal is not None:
                self.on_fatal(self.load_error)
            return
        if self.shutting_down:
            runtime.close()
            return
        self.runtime = runtime
        settings = self.settings
        default_drafter = settings.drafter if settings.speculative_config().speculates else "none"
        self.metrics.max_batch_size = runtime.settings.max_batch_size  # 1 when the model cannot be batched
        self.metrics.touch(settings.method.value, default_drafter, settings.num_speculative_tokens)
        if settings.record_traffic is not None:
            self.recorder = TrafficRecorder(settings.record_traffic, settings.record_traffic_max_bytes)
        self.worker = EngineWorker(
            runtime.engine,
            self.metrics,
            settings.max_queue,
            self._forward_ok,
            max_batch_size=runtime.settings.max_batch_size,  # 1 when the model cannot be batched
            max_batched_tokens=settings.max_batched_tokens,
            idle_work=runtime.refine_costs,
            record=self.recorder.record if self.recorder is not None else None,
            model_identity=runtime.target.identity,
            on_dead=self._engine_died,
        )
        self.worker.start()
        self._reload_on_sighup()
        log.info("model %s loaded; probing", runtime.model_id)
        self._probe_task = asyncio.get_running_loop().create_task(self._probe())

    def _forward_ok(self) -> None:  # called from the worker thread; one float assignment
        self.last_forward_ok = time.monotonic()

    def _engine_died(self, reason: str) -> None:  # called from the worker thread
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is stopping anyway
            self._loop.call_soon_threadsafe(self._on_engine_dead, reason)

    def _on_engine_dead(self, reason: str) -> None:
        log.critical("the engine is dead (%s): stopping the server so that it is restarted", reason)
        if self.on_fatal is not None:
            self.on_fatal(f"the engine died: {reason}")

    @property
    def engine_dead(self) -> str | None:
        """Why the engine cannot go on (None while it can, and before it starts)."""
        return self.worker.dead if self.worker is not None else None

    def begin_shutdown(self) -> None:
        if not self.shutting_down:
            log.info("shutting down: refusing new requests, draining running ones")
        self.shutting_down = True

    def end_generations(self) -> None:
        """The shutdown grace is over: every request still running gets a 503 now (a stream its error event
        and [DONE]), so its connection closes cleanly instead of being cancelled mid-write by uvicorn."""
        if self.worker is None:
            return
        error = shutting_down(
            f"the server is shutting down and its shutdown grace ({self.settings.shutdown_grace_s:g}s) ended "
            "before this generation finished; retry on another replica"
        )
        ended = self.worker.end_all(error)
        if ended:
            log.warning("shutdown grace ended: stopped %d running or waiting request(s) with a 503", ended)

    async def stop(self) -> None:
        self.begin_shutdown()
        if self._probe_task is not None and not self._probe_task.done():
            self._probe_task.cancel()
        if self.worker is not None:
            await asyncio.to_thread(self.worker.stop)
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.close)
        if self.runtime is not None:
            await asyncio.to_thread(self.runtime.close)

    # ------------------------------------------------------------ draft head reload

    async def reload_head(self, folder: Path | None = None, carry_ocm: bool = False) -> dict:
        """Load a draft head (default: the one the server started with), check it against the target, and
        swap it in between two engine rounds. Raises APIError (the old head keeps serving) when it cannot.
        `carry_ocm`: copy the retired head's OCM counts into the new head's namespace (see head_reload)."""
        runtime, worker = self.require_serving()
        return await reload_head(runtime, worker, folder, self.head_reloads, carry_ocm)

    def _reload_on_sighup(self) -> None:
        """SIGHUP reloads the head from its folder (a server process only: signals need the main thread)."""
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGHUP"):
            return
        loop = asyncio.get_running_loop()

        async def reload() -> None:
            try:
                result = await self.reload_head(None)
                log.info("SIGHUP: draft head reloaded: %s", result["identity"])
            except APIError as exc:
                log.error("SIGHUP: draft head not reloaded: %s", exc.message)

        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(reload()))

    # ------------------------------------------------------------ serving

    def require_serving(self) -> tuple[Runtime, EngineWorker]:
        """The runtime and worker, or a 503 saying why there are none."""
        retry = {"Retry-After": "5"}
        if self.engine_dead is not None:
            raise engine_dead()
        if self.shutting_down:
            raise shutting_down()
        if self.load_error is not None:
            raise APIError(
                503, f"the model failed to load: {self.load_error}", type=UNAVAILABLE, code="load_failed"
            )
        if self.runtime is None or self.worker is None:
            raise APIError(
                503, "the model is still loading", type=UNAVAILABLE, code="not_ready", headers=retry
            )
        return self.runtime, self.worker

    def store_status(self) -> StoreStatus | None:
        return self.runtime.store.status() if self.runtime is not None else None

    # ------------------------------------------------------------ readiness

    async def readiness(self) -> tuple[bool, dict]:
        """(ready, body). Ready means: a target forward succeeded within ready_probe_interval_s, or a
        1-token probe generation just did."""
        if self.load_error is not None:
            return False, {"status": "failed", "detail": self.load_error}
        if self.engine_dead is not None:  # before shutting_down: the death is what stops the server
            return False, {"status": "dead", "detail": f"engine dead: {self.engine_dead}"}
        if self.shutting_down:
            return False, {"status": "shutting_down"}
        if self.runtime is None or self.worker is None:
            return False, {"status": "loading", "model": self.settings.model}
        age = None if self.last_forward_ok is None else time.monotonic() - self.last_forward_ok
        if age is None or age > self.settings.ready_probe_interval_s:
            error = await self.probe()
            if error is not None:
                return False, {"status": "unhealthy", "detail": error}
            age = time.monotonic() - (self.last_forward_ok or time.monotonic())
        return True, {"status": "ready", "model": self.runtime.model_id, "last_forward_age_s": round(age, 3)}

    async def probe(self) -> str | None:
        """Run (or join) a 1-token generation; None when it worked, else why not."""
        if self._probe_task is None or self._probe_task.done():
            self._probe_task = asyncio.get_running_loop().create_task(self._probe())
        try:
            return await asyncio.wait_for(
                asyncio.shield(self._probe_task), timeout=self.settings.ready_probe_timeout_s
            )
        except asyncio.TimeoutError:
            return f"the probe generation did not finish within {self.settings.ready_probe_timeout_s}s"

    def _announce_ready(self, runtime: Runtime) -> None:
        """One line an operator (or a script) can wait for: the model answers, and where."""
        if not self._announced_ready:
            self._announced_ready = True
            log.info(
                "ready: serving %s on %s (%.1f s after start)",
                runtime.model_id,
                self.address or f"{self.settings.host}:{self.settings.port}",
                time.monotonic() - self.started,
            )

    async def _probe(self) -> str | None:
        runtime, worker = self.runtime, self.worker
        assert runtime is not None and worker is not None
        try:
            ids = await asyncio.to_thread(encode_prompt, runtime.target.tokenizer, PROBE_PROMPT)
            plan = GenerationPlan(
                prompt_ids=ids,
                sampling=SamplingParams(max_tokens=1),
                spec=SpeculativeConfig(method=Method.VANILLA, num_speculative_tokens=0),
                drafter="none",
                internal=True,
            )
            job = Job(
                plan, asyncio.get_running_loop(), time.monotonic() + self.settings.ready_probe_timeout_s
            )
            worker.submit(job, priority=True)
            try:
                while True:
                    event = await job.next_event()
                    if isinstance(event, DoneEvent):
                        self.probe_error = None
                        self._announce_ready(runtime)
                        return None
                    if isinstance(event, ErrorEvent):
                        raise RuntimeError(event.error.message)
            finally:
                worker.cancel(job, "probe finished")
        except (APIError, RuntimeError, DecodingError) as exc:
            message = exc.message if isinstance(exc, APIError) else str(exc)
            self.probe_error = f"probe generation failed: {message}"
            log.error("%s", self.probe_error)
            return self.probe_error
