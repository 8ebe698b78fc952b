"""A throwaway `redis-server` on a free port in a directory of its own, for tests and benchmarks.

Durable the way the shared OCM expects a production server to be: AOF on, fsync on every write, no RDB
snapshots; or, with `persistent=False`, a server that comes back empty after every restart (a cache-style
Redis, the case the OCM's restore from the replicas' views is for). Never the machine's own server: the port is chosen free, the data lives in `directory`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    def __init__(
        self,
        directory: Path,
        *,
        password: str | None = None,
        extra_args: tuple[str, ...] = (),
        tls: dict[str, str] | None = None,
        persistent: bool = True,
        port: int | None = None,
    ) -> None:
        """tls: {"cert": path, "key": path, "ca": path} serves TLS only (the plain port is closed)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.persistent = persistent
        self.password = password
        self.tls = tls
        self.extra_args = extra_args
        self.log_path = self.directory / "redis.log"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        args = [self.binary, "--bind", "127.0.0.1", "--dir", str(self.directory),
                "--appendonly", "yes" if self.persistent else "no", "--appendfsync", "always", "--save", "",
                "--daemonize", "no", "--logfile", ""]  # fmt: skip
        if self.tls:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.tls["cert"],
                     "--tls-key-file", self.tls["key"], "--tls-ca-cert-file", self.tls["ca"],
                     "--tls-auth-clients", "no"]  # fmt: skip
        else:
            args += ["--port", str(self.port)]
        if self.password:
            args += ["--requirepass", self.password]
        return args + list(self.extra_args)

    def start(self, timeout: float = 20.0) -> RedisProcess:
        with open(self.log_path, "ab") as log:
            offset = log.tell()
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited at start:\n{self._log_since(offset)}")
            if "Ready to accept connections" in self._log_since(offset):
                return self
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not become ready:\n{self._log_since(offset)}")

    def _log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL: a crash. With appendfsync always, every acknowledged write is on disk."""
        self.signal(signal.SIGKILL)
        self._wait()

    def stop(self) -> None:
        self.signal(signal.SIGCONT)  # in case it was frozen
        self.signal(signal.SIGTERM)
        self._wait()

    def freeze(self) -> None:
        """SIGSTOP: the server hangs with its sockets open, like a network that stopped answering."""
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def _wait(self) -> None:
        if self.process is not None:
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
