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


def test_cors_is_off_by_default_and_takes_json_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CSD_ALLOWED_ORIGINS", "CSD_ALLOWED_METHODS", "CSD_ALLOW_CREDENTIALS"):
        monkeypatch.delenv(name, raising=False)
    assert Settings().allowed_origins == []
    monkeypatch.setenv("CSD_ALLOWED_ORIGINS", '["https://app.example", "http://localhost:3000"]')
    monkeypatch.setenv("CSD_ALLOWED_METHODS", '["GET", "POST"]')
    settings = Settings()
    assert settings.allowed_origins == ["https://app.example", "http://localhost:3000"]
    assert settings.allowed_methods == ["GET", "POST"]
    assert settings.allowed_headers == ["*"]


def test_cors_credentials_need_explicit_origins() -> None:
    with pytest.raises(ValueError, match="allow_credentials"):
        Settings(allowed_origins=["*"], allow_credentials=True)
    assert Settings(allowed_origins=["https://app.example"], allow_credentials=True).allow_credentials


def test_cors_flags_like_vllm() -> None:
    from service.cli import CLIError, build_parser, settings_from_args

    args = build_parser().parse_args(
        ["serve", "--allowed-origins", '["https://app.example"]', "--allowed-headers", '["authorization"]',
         "--allow-credentials"]
    )  # fmt: skip
    settings = settings_from_args(args)
    assert settings.allowed_origins == ["https://app.example"]
    assert settings.allowed_headers == ["authorization"]
    assert settings.allow_credentials is True
    with pytest.raises(SystemExit):  # argparse: not a JSON list
        build_parser().parse_args(["serve", "--allowed-origins", "https://app.example"])
    args = build_parser().parse_args(["serve", "--allowed-origins", '["*"]', "--allow-credentials"])
    with pytest.raises(CLIError, match="allow_credentials"):
        settings_from_args(args)


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


def test_the_draft_pool_scope_flag_reaches_the_settings(monkeypatch):
    """`--draft-pool-scope shared` (or CSD_DRAFT_POOL_SCOPE) pools the suffix drafter's outputs across API keys;
    the default keeps each key's own, and anything else is refused by the parser."""
    from service.cli import build_parser, settings_from_args

    monkeypatch.delenv("CSD_DRAFT_POOL_SCOPE", raising=False)
    assert settings_from_args(build_parser().parse_args(["serve"])).draft_pool_scope == "tenant"
    shared = settings_from_args(build_parser().parse_args(["serve", "--draft-pool-scope", "shared"]))
    assert shared.draft_pool_scope == "shared"
    monkeypatch.setenv("CSD_DRAFT_POOL_SCOPE", "shared")
    assert settings_from_args(build_parser().parse_args(["generate", "hi"])).draft_pool_scope == "shared"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--draft-pool-scope", "everyone"])
