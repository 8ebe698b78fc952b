"""The key schema and URL masking (pure functions, no server)."""

from __future__ import annotations

import pytest

from ocm_store import Namespace, keys
from ocm_store.redaction import Scrubber, mask_url

NS = Namespace("HuggingFaceTB/SmolLM2-135M-Instruct@abc", "ngram", "0123abcd")


def test_every_key_of_a_namespace_lives_under_the_versioned_prefix_in_one_hash_slot():
    k = keys.keys_for(NS)
    assert k.counts == f"csd:ocm:v1:{{{keys.namespace_id(NS)}}}"
    for key in k.all + [keys.REGISTRY]:
        assert key.startswith(keys.PREFIX + ":")
    assert {key.split("{")[1].split("}")[0] for key in k.all} == {k.id}  # one cluster hash tag
    assert keys.namespace_id(NS) != keys.namespace_id(Namespace(NS.target, "model:x", NS.vocab))


@pytest.mark.parametrize(
    ("field", "parsed"),
    [(b"12:34", (12, 34)), ("0:0", (0, 0)), (b"12:x", None), (b"1:2:3", None), (b"-1:2", None),
     (b" 1:2", None), ("1_0:2", None), ("²:1", None), (b"\xff:1", None), (b"hello", None)],
)  # fmt: skip
def test_pattern_fields_parse_strictly(field, parsed):
    assert keys.parse_field(field) == parsed


@pytest.mark.parametrize(
    ("value", "parsed"),
    [(b"7", 7), ("0", 0), (5, 5), (b"-3", None), (b"banana", None), (b"1_000", None), (b" 7", None),
     (b"7.0", None), (None, None), (-1, None)],
)  # fmt: skip
def test_counts_parse_strictly(value, parsed):
    assert keys.parse_count(value) == parsed


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://:s3cret@host:6379/0", "redis://:***@host:6379/0"),
        ("redis://alice:s3cret@host/0", "redis://alice:***@host/0"),
        ("rediss://alice:p%40ss@host:6380/1?ssl_ca_certs=/ca.pem", "rediss://alice:***@host:6380/1?ssl_ca_certs=/ca.pem"),
        ("redis://host:6379/0?password=s3cret", "redis://host:6379/0?password=***"),
        ("redis://host:6379/0", "redis://host:6379/0"),
    ],
)  # fmt: skip
def test_urls_are_shown_masked(url, masked):
    assert mask_url(url) == masked


def test_the_scrubber_removes_the_password_in_every_spelling():
    scrub = Scrubber("redis://alice:p%40ss@host/0")
    assert scrub("failed with p%40ss and p@ss") == "failed with *** and ***"
