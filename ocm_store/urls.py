"""The one place a shared-OCM URL becomes a redis-py client: a single server, a Sentinel service or a Cluster.

    redis://[user:password@]host:port[/db][?options]                  one server (redis-py's own form)
    rediss://...                                                       the same over TLS
    redis+sentinel://[user:password@]host:port[,host:port...]/service[/db][?options]
    rediss+sentinel://...                                              TLS to the sentinels and the servers
    redis+cluster://[user:password@]host:port[,host:port...][?options]
    rediss+cluster://...                                               TLS to every node

`user:password` is the ACL user (or the `requirepass` password) of the data servers, as with `redis://`.
Sentinels usually have no password of their own; when they do, give it as `sentinel_password=` (and
`sentinel_username=`) in the query. Every other query option is one of redis-py's URL options (`ssl_ca_certs`,
`ssl_certfile`, `ssl_keyfile`, `ssl_cert_reqs`, `socket_timeout`, ...) and applies to every connection.
A Cluster has one database: a `/db` other than 0 is refused.

Failover is redis-py's, never ours: `redis.sentinel.Sentinel(...).master_for(service)` asks the sentinels
for the current master on every new connection (and turns a demoted master's READONLY answer into a
connection error), and `redis.cluster.RedisCluster` follows MOVED/ASK redirections and the slot map.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import SSLConnection, parse_url
from redis.sentinel import Sentinel

Kind = Literal["single", "sentinel", "cluster"]
SCHEMES: dict[str, tuple[Kind, bool]] = {
    "redis": ("single", False),
    "rediss": ("single", True),
    "unix": ("single", False),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
}
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
DEFAULT_PORTS = {"single": 6379, "sentinel": 26379, "cluster": 6379}


@dataclass(frozen=True)
class RedisTarget:
    kind: Kind
    tls: bool
    nodes: tuple[tuple[str, int], ...] = ()  # sentinels or cluster seed nodes (empty for "single")
    service: str = ""  # the Sentinel master name
    options: dict[str, Any] = field(default_factory=dict)  # redis-py connection keywords for the servers
    sentinel_options: dict[str, Any] = field(default_factory=dict)


def parse_redis_url(url: str) -> RedisTarget:
    """Parse any of the forms above; ValueError (never showing the password) for anything else."""
    scheme, sep, _rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise ValueError(f"the URL scheme must be one of {', '.join(s + '://' for s in SCHEMES)}")
    kind, tls = SCHEMES[scheme.lower()]
    if kind == "single":
        return RedisTarget(kind, tls, options=parse_url(url))
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    nodes = tuple(_host_port(h, DEFAULT_PORTS[kind]) for h in hosts.split(",") if h)
    if not nodes:
        raise ValueError(f"a {scheme}:// URL needs at least one host:port")
    query = parse_qsl(parts.query, keep_blank_values=True)
    sentinel_options = {k: v for k, v in query if k in SENTINEL_OPTIONS and v}
    rest = urlencode([(k, v) for k, v in query if k not in SENTINEL_OPTIONS])
    segments = [unquote(s) for s in parts.path.split("/") if s]
    service, db = "", "0"
    if kind == "sentinel":
        if not segments:
            raise ValueError("a redis+sentinel:// URL names the master: .../service_name[/db]")
        service, db = segments[0], segments[1] if len(segments) > 1 else "0"
        if len(segments) > 2:
            raise ValueError("a redis+sentinel:// URL path is /service_name[/db]")
    elif segments not in ([], ["0"]):
        raise ValueError("a Redis Cluster has database 0 only: no /db in a redis+cluster:// URL")
    # The server options are redis-py's own URL options, parsed by redis-py on an equivalent plain URL.
    options = parse_url(f"{'rediss' if tls else 'redis'}://{userinfo}{at}{hosts.split(',')[0]}/{db}?{rest}")
    for key in ("host", "port"):
        options.pop(key, None)
    if options.pop("connection_class", None) is SSLConnection:
        options["ssl"] = True
    if kind == "cluster":
        options.pop("db", None)
    return RedisTarget(kind, tls, nodes, service, options, sentinel_options)


def open_client(url: str, **connection: Any) -> redis.Redis | RedisCluster:
    """A redis-py client for the URL; `connection` (timeouts, retry, client name) applies to every node."""
    target = parse_redis_url(url)
    if target.kind == "single":
        return redis.Redis.from_url(url, **connection)
    if target.kind == "cluster":
        nodes = [ClusterNode(host, port) for host, port in target.nodes]
        return RedisCluster(startup_nodes=nodes, **target.options, **connection)
    tls = {k: v for k, v in target.options.items() if k.startswith("ssl")}
    sentinel_kwargs = {
        **tls,
        **{k.removeprefix("sentinel_"): v for k, v in target.sentinel_options.items()},
        **{k: v for k, v in connection.items() if k.startswith("socket_") or k == "retry"},
    }
    sentinel = Sentinel(list(target.nodes), sentinel_kwargs=sentinel_kwargs)
    return sentinel.master_for(target.service, **target.options, **connection)


def _host_port(text: str, default_port: int) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        return text, default_port
    if host.startswith("[") and host.endswith("]"):  # [::1]:26379
        host = host[1:-1]
    if not port.isdigit():
        raise ValueError(f"bad port in {text!r}")
    return host, int(port)
