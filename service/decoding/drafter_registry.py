"""Every drafter a server can offer, declared once: its name, what it is, what it needs, how it is built.

Settings, the request schema, the CLI, request planning and the runtime all read this table, so adding a
drafter is one file in `drafters/` plus one `DrafterEntry` here (docs/drafters.md shows it). Importing this
module costs no torch: the builders import their drafter when they run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from service.decoding.drafters.base import Drafter
    from service.decoding.drafters.head import HeadDrafter
    from service.executor.models import LoadedModel


@dataclass
class DrafterInputs:
    """What the runtime loaded that a drafter may be built from."""

    target: LoadedModel
    ngram_min: int
    ngram_max: int
    draft: LoadedModel | None = None  # --draft-model
    head: HeadDrafter | None = None  # --draft-head (the shipped head on the embedded model)
    built: dict[str, Drafter] = field(default_factory=dict)  # the entries above this one, by name


@dataclass(frozen=True)
class DrafterEntry:
    name: str
    description: str  # one phrase, for --help and the API schema
    # the server setting it cannot be built without (None: always available)
    needs: Literal["draft_head", "draft_model"] | None
    hint: str  # told to a client that asks for it on a server without it
    build: Callable[[DrafterInputs], Drafter | None]  # None: what it needs was not loaded


def _ngram(inputs: DrafterInputs) -> Drafter:
    from service.decoding.drafters.ngram import NgramDrafter

    return NgramDrafter(inputs.ngram_min, inputs.ngram_max)


def _suffix(inputs: DrafterInputs) -> Drafter:
    from service.decoding.drafters.suffix import SuffixDrafter

    return SuffixDrafter()


def _model(inputs: DrafterInputs) -> Drafter | None:
    from service.decoding.drafters.model import ModelDrafter

    return None if inputs.draft is None else ModelDrafter(inputs.draft)


def _head(inputs: DrafterInputs) -> Drafter | None:
    return inputs.head


def _combined(inputs: DrafterInputs) -> Drafter | None:
    from service.decoding.drafters.combined import CombinedDrafter

    return None if inputs.head is None else CombinedDrafter(inputs.built["ngram"], inputs.head)


def _combined_suffix(inputs: DrafterInputs) -> Drafter | None:
    from service.decoding.drafters.combined import CombinedDrafter

    if inputs.head is None:
        return None
    return CombinedDrafter(inputs.built["suffix"], inputs.head, name="combined-suffix")


_NO_HEAD = "the server has no draft head for its model: --draft-head FOLDER"

# In build order: an entry may use the drafters built above it.
DRAFTERS: tuple[DrafterEntry, ...] = (
    DrafterEntry("ngram", "prompt lookup", None, "", _ngram),
    DrafterEntry("suffix", "suffix trees over the request and earlier outputs", None, "", _suffix),
    DrafterEntry(
        "model",
        "a draft model",
        "draft_model",
        "start the server with --draft-model (embedded-exit: one shipped for the embedded model)",
        _model,
    ),
    DrafterEntry("head", "the trained draft head", "draft_head", _NO_HEAD, _head),
    DrafterEntry(
        "combined", "prompt lookup where it matches, else the head", "draft_head", _NO_HEAD, _combined
    ),
    DrafterEntry(
        "combined-suffix",
        "the suffix drafter where it matches, else the head",
        "draft_head",
        _NO_HEAD,
        _combined_suffix,
    ),
)
DRAFTER_NAMES: tuple[str, ...] = tuple(entry.name for entry in DRAFTERS)
# for a pydantic field or a type hint: exactly the registered names
DrafterName = Literal[DRAFTER_NAMES]  # type: ignore[valid-type]


def drafter_entry(name: str) -> DrafterEntry:
    for entry in DRAFTERS:
        if entry.name == name:
            return entry
    raise KeyError(name)


def describe_drafters() -> str:
    """ "ngram (prompt lookup), model (a draft model), ...": the help text of every `drafter` option."""
    return ", ".join(f"{entry.name} ({entry.description})" for entry in DRAFTERS)


def build_drafters(inputs: DrafterInputs) -> dict[str, Drafter]:
    """Every registered drafter whose needs were loaded, by name."""
    for entry in DRAFTERS:
        drafter = entry.build(inputs)
        if drafter is not None:
            inputs.built[entry.name] = drafter
    return dict(inputs.built)
