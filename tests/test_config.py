"""Settings from CSD_* environment variables."""

from __future__ import annotations

import pytest

from service.config import Settings


def test_api_keys_from_the_environment_are_a_comma_separated_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CSD_API_KEYS", "sk-one, sk-two,")
    keys = Settings().api_keys
    assert [k.get_secret_value() for k in keys] == ["sk-one", "sk-two"]
    assert "sk-one" not in repr(Settings())  # secrets stay out of reprs and logs


def test_no_api_keys_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CSD_API_KEYS", raising=False)
    assert Settings().api_keys == []


def test_prefix_caching_flags_reach_the_settings(monkeypatch):
    """`--no-enable-prefix-caching` and `--prefix-cache-gib` override the default (on, bound from memory)."""
    from service.cli import build_parser, settings_from_args

    for key in ("CSD_ENABLE_PREFIX_CACHING", "CSD_PREFIX_CACHE_GIB"):
        monkeypatch.delenv(key, raising=False)
    default = settings_from_args(build_parser().parse_args(["serve"]))
    assert default.enable_prefix_caching and default.prefix_cache_gib is None
    off = settings_from_args(build_parser().parse_args(["serve", "--no-enable-prefix-caching"]))
    assert not off.enable_prefix_caching
    sized = settings_from_args(build_parser().parse_args(["serve", "--prefix-cache-gib", "0.25"]))
    assert sized.enable_prefix_caching and sized.prefix_cache_gib == 0.25
