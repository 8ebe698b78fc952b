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
