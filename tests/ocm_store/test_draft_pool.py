"""The suffix drafter's outputs pooled across replicas through a real redis-server (ocm_store/draft_pool.py):
what one replica served shapes another's drafts, for the same tenant only; a replica started later reads the
recent stream back; with Redis away nothing raises and drafting goes on locally."""

from __future__ import annotations

import time

import redis

from ocm_store.draft_pool import RedisDraftPool, stream_key, unpack_tokens
from service.decoding import SamplingParams
from service.decoding.drafters import DraftRow
from service.decoding.drafters.suffix import SuffixDrafter

NAMESPACE = "target@rev|vocab-hash"
OUTPUT = list(range(300, 340))


def replica(url: str, **kwargs) -> tuple[SuffixDrafter, RedisDraftPool]:
    """A replica's suffix drafter with its pool attached, as the runtime wires them."""
    drafter = SuffixDrafter(
        max_spec_factor=1.0, prompt_tail=0
    )  # a draft as long as its match, of outputs only
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=3)
    pool = RedisDraftPool(client, NAMESPACE, drafter.fold, block_ms=100, **kwargs)
    drafter.pool_sink = pool.start()
    assert pool.caught_up.wait(10), "the pool never read the stream back"
    return drafter, pool


def serve(drafter: SuffixDrafter, pool: str | None, prompt: list[int], output: list[int]) -> None:
    """One request through the drafter's batch interface: proposes on the prompt, leaves with its output."""
    rows, seq = drafter.rows(), object()
    rows.propose([DraftRow(seq, prompt, 8, SamplingParams(), None, None, pool)])
    rows.propose([DraftRow(seq, prompt + output, 8, SamplingParams(), None, None, pool)])
    rows.leave(seq)


def drafted(drafter: SuffixDrafter, pool: str | None) -> list[int]:
    """What a new request of `pool` whose text ends like OUTPUT's beginning is drafted."""
    context = [1, 2, *OUTPUT[:6]]
    return (
        drafter.rows().propose([DraftRow(object(), context, 8, SamplingParams(), None, None, pool)])[0].tokens
    )


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_one_replicas_output_drafts_for_the_same_tenant_on_another_replica_only(redis_server, redis_client):
    first, first_pool = replica(redis_server.url)
    second, second_pool = replica(redis_server.url)
    try:
        assert drafted(second, "tenant-a") == []
        serve(first, "tenant-a", [5, 6, 7], OUTPUT)
        assert wait_for(lambda: second.global_trees.outputs("tenant-a") == 1)
        assert drafted(second, "tenant-a") == OUTPUT[6:12]  # a 6-token match drafts 6
        # another tenant's requests, and requests without a pool, never see it
        assert drafted(second, "tenant-b") == [] and drafted(second, None) == []
        assert second.global_trees.outputs("tenant-b") == 0
        # the stream holds the entry as documented; the publisher did not fold its own entry twice
        ((_, fields),) = redis_client.xrange(stream_key(NAMESPACE))
        assert fields[b"p"] == b"tenant-a" and unpack_tokens(fields[b"t"]) == OUTPUT
        assert first.global_trees.outputs("tenant-a") == 1 and first_pool.folded == 0
        assert first_pool.published == 1 and second_pool.folded == 1
    finally:
        first_pool.close()
        second_pool.close()


def test_a_replica_started_later_reads_the_recent_outputs_back(redis_server):
    first, first_pool = replica(redis_server.url)
    for i in range(5):
        serve(first, "tenant-a", [i], [1000 + i, *OUTPUT])
    assert wait_for(lambda: first_pool.published == 5)
    first_pool.close()  # the first replica is gone: the newcomer learns from the stream alone
    late, late_pool = replica(redis_server.url, read_back=3)
    try:
        assert late.global_trees.outputs("tenant-a") == 3  # the last `read_back` entries
        assert drafted(late, "tenant-a") == OUTPUT[6:12]
    finally:
        late_pool.close()


def test_the_stream_is_capped(redis_server, redis_client):
    drafter, pool = replica(redis_server.url, max_len=10)
    try:
        for i in range(300):
            serve(drafter, "t", [i], [i, i + 1])
        assert wait_for(lambda: pool.published == 300)
        # MAXLEN ~: Redis trims whole macro nodes (100 entries each by default), so about the cap
        assert redis_client.xlen(stream_key(NAMESPACE)) <= 110
    finally:
        pool.close()


def test_without_redis_nothing_raises_and_drafting_stays_local(redis_server):
    drafter, pool = replica(redis_server.url)
    try:
        redis_server.stop()
        serve(drafter, "tenant-a", [5, 6, 7], OUTPUT)  # publishing with Redis away: no exception
        assert drafted(drafter, "tenant-a") == OUTPUT[6:12]  # this replica's own tree still drafts
        assert wait_for(lambda: pool.dropped == 1)
        redis_server.start()  # the same port: the writer and the reader come back by themselves
        serve(drafter, "tenant-a", [8], OUTPUT)
        assert wait_for(lambda: pool.published == 1)
    finally:
        pool.close()
