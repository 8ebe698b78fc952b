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


def free_cluster_port() -> int:
    """A free port P with P + 10000 free too (a cluster node's bus port), so P <= 55535."""
    import random

    for _ in range(200):
        port = random.randint(20000, 55000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


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


def _wait_for_ping(port: int, timeout: float, process: subprocess.Popen, log_path: Path) -> None:
    import redis  # only the helpers below need a client

    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server exited at start:\n{log_path.read_text()}")
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on {port} did not answer:\n{log_path.read_text()}")
    finally:
        client.close()


class SentinelSetup:
    """A master, a replica of it and one sentinel monitoring them as `service` (quorum 1, failure detection
    after `down_after_ms`): the smallest real Sentinel deployment, for tests."""

    def __init__(self, directory: Path, service: str = "ocm", down_after_ms: int = 500) -> None:
        self.directory = Path(directory)
        self.service = service
        self.master = RedisProcess(self.directory / "master")
        self.replica = RedisProcess(
            self.directory / "replica", extra_args=("--replicaof", "127.0.0.1", str(self.master.port))
        )
        self.down_after_ms = down_after_ms
        self.sentinel_port = free_port()
        self.sentinel: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        # a closed port first: redis-py must go on to the next sentinel
        return f"redis+sentinel://127.0.0.1:{free_port()},127.0.0.1:{self.sentinel_port}/{self.service}"

    def start(self) -> SentinelSetup:
        self.master.start()
        self.replica.start()
        folder = self.directory / "sentinel"
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "sentinel.conf"
        config.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {folder}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.service} 5000\n"
        )
        log_path = folder / "sentinel.log"
        with open(log_path, "ab") as log:
            self.sentinel = subprocess.Popen(
                [self.master.binary, str(config), "--sentinel"], stdout=log, stderr=subprocess.STDOUT
            )
        _wait_for_ping(self.sentinel_port, 20, self.sentinel, log_path)
        self.wait_replicated()
        return self

    def master_port(self) -> int:
        import redis

        client = redis.Redis(port=self.sentinel_port)
        try:
            return int(client.sentinel_get_master_addr_by_name(self.service)[1])
        finally:
            client.close()

    def wait_replicated(self, timeout: float = 20) -> None:
        """Until the sentinel knows the replica and the replica's link to the master is up."""
        import redis

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with redis.Redis(port=self.sentinel_port) as s:
                replicas = s.sentinel_slaves(self.service)
            if replicas and all(r.get("master-link-status") == "ok" for r in replicas):
                return
            time.sleep(0.05)
        raise RuntimeError("the sentinel did not see a replicated master in time")

    def failover(self) -> None:
        """SENTINEL FAILOVER: promote the replica, demote the master (both keep running)."""
        import redis

        with redis.Redis(port=self.sentinel_port) as s:
            s.sentinel_failover(self.service)

    def stop(self) -> None:
        if self.sentinel is not None and self.sentinel.poll() is None:
            self.sentinel.terminate()
            self.sentinel.wait(timeout=20)
        self.replica.stop()
        self.master.stop()


class ClusterSetup:
    """A Redis Cluster of `masters` nodes, no replicas, created with `redis-cli --cluster create`."""

    def __init__(self, directory: Path, masters: int = 3) -> None:
        self.nodes = [
            RedisProcess(
                Path(directory) / f"node{i}",
                port=free_cluster_port(),
                extra_args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ),  # fmt: skip
            )
            for i in range(masters)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2])

    def start(self, timeout: float = 30) -> ClusterSetup:

        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> ClusterSetup:
        import redis

        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed")
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes), "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=timeout,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            for node in self.nodes:
                with redis.Redis(port=node.port, decode_responses=True) as c:
                    states.append(c.execute_command("CLUSTER", "INFO"))
            if all("cluster_state:ok" in str(s) for s in states):
                return self
            time.sleep(0.05)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
