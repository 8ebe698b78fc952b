"""GET /v1/models and GET /v1/models/{model}."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import Authorized, ServingRuntime, State
from service.api.errors import APIError
from service.api.openapi import error_responses
from service.api.plan import served_names
from service.api.schemas import ModelCard, ModelList
from service.api.state import ServiceState
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
