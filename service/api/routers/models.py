"""GET /v1/models, GET /v1/models/{model} and GET /v1/drafters."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field

from service.api.deps import Authorized, ServingRuntime, State
from service.api.errors import APIError
from service.api.openapi import error_responses
from service.api.plan import served_names
from service.api.schemas import ModelCard, ModelList
from service.api.state import ServiceState
from service.decoding.drafter_registry import DRAFTERS
from service.runtime import Runtime

router = APIRouter(
    prefix="/v1", tags=["models"], dependencies=[Authorized], responses=error_responses(401, 503)
)


@router.get("/models", response_model=ModelList)
async def list_models(state: State, runtime: ServingRuntime) -> ModelList:
    return ModelList(data=[_card(state, runtime)])


@router.get(
    "/models/{model:path}",
    response_model=ModelCard,
    responses=error_responses(404),
)
async def get_model(model: str, state: State, runtime: ServingRuntime) -> ModelCard:
    if model not in served_names(runtime):
        raise APIError(
            404, f"the model {model!r} does not exist on this server", param="model", code="model_not_found"
        )
    return _card(state, runtime)


def _card(state: ServiceState, runtime: Runtime) -> ModelCard:
    return ModelCard(id=runtime.model_id, created=state.created, max_model_len=runtime.target.max_context)


# The drafter list's shapes live here, beside the one route that sends them (as admin.py keeps its own).
class DrafterCard(BaseModel):
    id: str = Field(description="the name a request gives as `speculative.drafter`")
    object: Literal["drafter"] = "drafter"
    description: str
    available: bool = Field(description="this server built it (what it needs was loaded)")
    default: bool = Field(description="the drafter a request without `speculative.drafter` gets")
    hint: str | None = Field(description="what the server needs to offer it; null where it is available")


class DrafterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[DrafterCard]


@router.get("/drafters", response_model=DrafterList)
async def list_drafters(state: State, runtime: ServingRuntime) -> DrafterList:
    """Every drafter in the registry (service/decoding/drafter_registry.py), the one list of them, in its
    order, each with whether this server can draft with it: a client (the playground) offers these and
    nothing else."""
    built = runtime.engine.drafters
    return DrafterList(
        data=[
            DrafterCard(
                id=entry.name,
                description=entry.description,
                available=entry.name in built,
                default=entry.name == state.settings.drafter,
                hint=None if entry.name in built else entry.hint,
            )
            for entry in DRAFTERS
        ]
    )
