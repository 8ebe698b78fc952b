"""One drafter registry: settings, the API schema, the CLI, planning and the runtime all read it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.api.schemas import SpeculativeOptions
from service.cli import build_parser
from service.config import Settings
from service.decoding.drafter_registry import DRAFTER_NAMES, DRAFTERS, describe_drafters, drafter_entry


def test_every_surface_offers_exactly_the_registered_drafters() -> None:
    schema = SpeculativeOptions.model_json_schema()["properties"]["drafter"]
    assert schema["anyOf"][0]["enum"] == list(DRAFTER_NAMES)
    assert schema["description"] == describe_drafters()
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    (drafter_option,) = [a for a in serve._actions if "--drafter" in a.option_strings]
    assert list(drafter_option.choices) == list(DRAFTER_NAMES)
    with pytest.raises(ValidationError):
        Settings(drafter="no-such-drafter")


@pytest.mark.parametrize("entry", DRAFTERS, ids=lambda e: e.name)
def test_settings_require_what_each_drafter_needs(entry) -> None:
    if entry.needs is None:
        assert Settings(drafter=entry.name).drafter == entry.name
        return
    with pytest.raises(ValidationError, match=entry.needs):
        Settings(drafter=entry.name, **{entry.needs: ""})
    assert entry.hint  # a client asking for it on a server without it is told how to get it
    assert drafter_entry(entry.name) is entry
