"""The shared OCM on highly available Redis, through redis-py's own clients, against real local servers:
a Sentinel deployment (master, replica, sentinel) failed over while replicas serve, and a Redis Cluster
(3 masters, created with `redis-cli --cluster create`) where every script must touch one slot."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import redis
from redis.cluster import RedisCluster

from bench.redis_process import ClusterSetup, SentinelSetup
from ocm_store import Namespace, keys
from ocm_store.redis_store import RedisStore
from ocm_store.urls import parse_redis_url
from tests.ocm_store.helpers import wait_until

NS = Namespace("target@rev", "head", "vocab")
PATTERNS = [(i, 900 + i % 5) for i in range(120)]


def open_store(url: str) -> RedisStore:
    return RedisStore(
        url, flush_interval_s=0.02, refresh_interval_s=0.1, max_backoff_s=0.2, connect_timeout_s=0.5
    )


def held(client, namespace: Namespace = NS) -> dict[tuple[int, int], int]:
    items = client.zrange(keys.keys_for(namespace).counts, 0, -1, withscores=True)
    return {keys.parse_field(m): int(s) for m, s in items}


# ---------------------------------------------------------------- URL forms (one parser)


@pytest.mark.parametrize(
    ("url", "kind", "nodes", "service", "options"),
    [
        ("redis://:pw@h:6380/2", "single", (), "", {"password": "pw", "host": "h", "port": 6380, "db": 2}),
        ("redis+sentinel://h1:26379,h2/ocm", "sentinel", (("h1", 26379), ("h2", 26379)), "ocm", {"db": 0}),
        ("rediss+sentinel://app:pw@h1:1/ocm/3?ssl_ca_certs=/ca.crt&sentinel_password=sp", "sentinel",
         (("h1", 1),), "ocm", {"username": "app", "password": "pw", "db": 3, "ssl": True,
                               "ssl_ca_certs": "/ca.crt"}),
        ("redis+cluster://a:7000,[::1]:7001", "cluster", (("a", 7000), ("::1", 7001)), "", {}),
        ("rediss+cluster://:pw@a:7000?ssl_cert_reqs=none", "cluster", (("a", 7000),), "",
         {"password": "pw", "ssl": True, "ssl_cert_reqs": "none"}),
    ],
)  # fmt: skip
def test_url_forms(url, kind, nodes, service, options):
    target = parse_redis_url(url)
    assert (target.kind, target.nodes, target.service, target.options) == (kind, nodes, service, options)


@pytest.mark.parametrize(
    "url",
    ["http://h:1", "redis+sentinel://h:1", "redis+sentinel://h:1/a/0/x", "redis+cluster://h:1/3",
     "redis+cluster:///", "redis+sentinel://h:port/ocm"],
)  # fmt: skip
def test_bad_urls_are_refused_in_one_line(url):
    with pytest.raises(ValueError):
        parse_redis_url(url)


def test_the_sentinel_password_is_masked_and_scrubbed():
    from ocm_store.redaction import Scrubber, mask_url

    url = "redis+sentinel://app:s3cret@h:1/ocm?sentinel_password=t0psecret"
    assert "s3cret" not in mask_url(url) and "t0psecret" not in mask_url(url)
    assert Scrubber(url)("auth t0psecret failed for s3cret") == "auth *** failed for ***"


# ---------------------------------------------------------------- Sentinel


class Load:
    """A thread per store recording patterns (and reading counts, as verification does), with a tally."""

    def __init__(self, stores) -> None:
        self.memories = [s.memory(NS) for s in stores]
        self.recorded: Counter = Counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(m, i)) for i, m in enumerate(self.memories)]

    def _run(self, memory, seed: int) -> None:
        i = seed
        try:
            while not self.stop.is_set():
                pattern = PATTERNS[i % len(PATTERNS)]
                memory.counts([pattern])
                memory.record([pattern])
                with self.lock:
                    self.recorded[pattern] += 1
                i += 7
                time.sleep(0.001)
        except BaseException as exc:
            self.errors.append(exc)

    def total(self) -> int:
        with self.lock:
            return sum(self.recorded.values())

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


def test_a_sentinel_failover_while_serving_loses_no_increment(tmp_path):
    setup = SentinelSetup(tmp_path / "sentinel").start()
    stores = [open_store(setup.url), open_store(setup.url)]
    try:
        first_master = setup.master_port()
        assert first_master == setup.master.port
        with Load(stores) as load:
            wait_until(lambda: load.total() > 500, timeout=30)
            assert all(s.flush() for s in stores)
            setup.failover()
            wait_until(lambda: setup.master_port() == setup.replica.port, timeout=30, step=0.05)
            at_failover = load.total()
            wait_until(lambda: load.total() > at_failover + 500, timeout=30)  # serving goes on
            wait_until(lambda: all(s.reachable() for s in stores), timeout=30, step=0.05)
            time.sleep(0.5)  # a few flushes on the new master under load
        assert not load.errors, load.errors
        truth = dict(load.recorded)
        new_master = redis.Redis(port=setup.replica.port)
        try:
            wait_until(lambda: all(s.flush() for s in stores) and held(new_master) == truth, timeout=30)
        finally:
            new_master.close()
        for s in stores:
            s.refresh()
            assert s.memory(NS).counts(list(truth)) == list(truth.values())
            assert s.status().healthy
    finally:
        for s in stores:
            s.close()
        setup.stop()


# ---------------------------------------------------------------- Cluster


def test_every_script_key_and_the_registry_hash_to_one_slot_each():
    from redis.crc import key_slot

    for ns in (NS, Namespace("a", "ngram", "v"), Namespace("b|c", "x", "y")):
        slots = {key_slot(k.encode()) for k in keys.keys_for(ns).all}
        assert len(slots) == 1
    assert keys.REGISTRY.count("{") == 0  # the registry is only ever written outside a script


def test_a_cluster_pools_restores_and_resets_with_one_slot_per_script(tmp_path):
    cluster = ClusterSetup(tmp_path / "cluster").start()
    namespaces = [Namespace(f"target{i}@rev", "head", "vocab") for i in range(6)]
    a, b = open_store(cluster.url), open_store(cluster.url)
    client = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    try:
        from redis.crc import key_slot

        slots = {key_slot(keys.keys_for(ns).counts.encode()) for ns in namespaces}
        nodes = {client.get_node_from_key(keys.keys_for(ns).counts).port for ns in namespaces}
        assert len(slots) == 6 and len(nodes) >= 2  # the namespaces really are spread over the nodes
        truth = {}
        for i, ns in enumerate(namespaces):
            a.memory(ns).record([PATTERNS[i]] * (i + 1))
            b.memory(ns).record([PATTERNS[i]] * 2)
            truth[ns] = {PATTERNS[i]: i + 3}
        for s in (a, b):
            wait_until(s.flush, timeout=10)
            s.refresh()
        for ns in namespaces:
            assert held(client, ns) == truth[ns]
            assert a.memory(ns).counts([PATTERNS[namespaces.index(ns)]]) == list(truth[ns].values())
        assert set(a.namespaces()) == set(namespaces)
        assert all(s.status().healthy for s in (a, b)), [s.status().detail for s in (a, b)]

        # Every node emptied (a restart without persistence): both replicas restore, nothing twice.
        for node in cluster.nodes:
            with redis.Redis(port=node.port) as n:
                n.flushall()
        for s in (a, b):
            wait_until(s.refresh, timeout=10)
        wait_until(lambda: all(held(client, ns) == truth[ns] for ns in namespaces), timeout=10)
        assert set(a.namespaces()) == set(namespaces)
        assert sum(s.status().extra["restored_increments"] for s in (a, b)) == sum(
            sum(t.values()) for t in truth.values()
        )

        a.reset()
        wait_until(lambda: b.memory(namespaces[0]).counts([PATTERNS[0]]) == [0] and b.refresh(), timeout=10)
        assert all(held(client, ns) == {} for ns in namespaces)
        assert a.namespaces() == [] and a.status().healthy
    finally:
        a.close()
        b.close()
        client.close()
        cluster.stop()


def test_csd_ocm_export_and_import_move_a_memory_from_one_redis_to_a_cluster(tmp_path, capsys, monkeypatch):
    import json

    from bench.redis_process import RedisProcess
    from service.cli import main

    monkeypatch.delenv("CSD_REDIS_URL", raising=False)
    monkeypatch.setenv("CSD_CACHE_DIR", str(tmp_path / "cache"))
    rows = [
        {"namespace": NS.key, "draft_token": i, "target_token": 900 + i, "count": i + 1} for i in range(40)
    ]
    seed, moved, back = tmp_path / "seed.jsonl", tmp_path / "moved.jsonl", tmp_path / "back.jsonl"
    seed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = RedisProcess(tmp_path / "source").start()
    cluster = ClusterSetup(tmp_path / "cluster").start()
    try:
        assert main(["ocm", "import", str(seed), "--redis-url", source.url]) == 0
        assert main(["ocm", "export", str(moved), "--redis-url", source.url]) == 0
        assert main(["ocm", "import", str(moved), "--redis-url", cluster.url]) == 0
        assert main(["ocm", "export", str(back), "--redis-url", cluster.url]) == 0
        got = [json.loads(line) for line in back.read_text().splitlines()]
        assert sorted(got, key=lambda r: r["draft_token"]) == rows
        # and a replica started on the new cluster serves with the moved memory from its first lookup
        store = open_store(cluster.url)
        try:
            assert store.memory(NS).counts([(39, 939)]) == [40]
        finally:
            store.close()
    finally:
        capsys.readouterr()
        cluster.stop()
        source.stop()
