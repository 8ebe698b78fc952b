"""POST /v1/admin/reload_drafter: load a new draft head and swap it in without a restart (service/api/head_reload.py)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from service.api.deps import Authorized, State
from service.api.openapi import error_responses

router = APIRouter(prefix="/v1/admin", tags=["admin"], dependencies=[Authorized])


class ReloadDrafterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    folder: str | None = Field(
        None,
        description="a head folder on the server (model.safetensors + config.json, e.g. what "
        "`python -m training --from-traffic` wrote); default: the folder the running head came from",
        min_length=1,
    )
    carry_ocm: bool = Field(
        False,
        description="copy the retired head's divergence counts into the new head's OCM namespace; by default "
        "a new head starts a fresh namespace, since counts learned for another drafter would steer it",
    )


class ReloadDrafterResponse(BaseModel):
    object: str = "drafter.reload"
    drafter: str
    folder: str
    previous_identity: str
    identity: str
    ocm_namespaces: list[str] = Field(description="the OCM namespaces that changed (empty: the same weights)")
    ocm_patterns_carried: int = Field(description="patterns copied from the retired namespaces (carry_ocm)")
    seconds: float


@router.post(
    "/reload_drafter", response_model=ReloadDrafterResponse, responses=error_responses(400, 401, 409, 503)
)
async def reload_drafter(state: State, body: ReloadDrafterRequest | None = None) -> ReloadDrafterResponse:
    """Load the draft head in `folder`, check it against the target (vocabulary, hidden size) and swap it
    in between two decoding rounds: generations in flight continue with the new head. A head that fails
    the checks is refused (400) and the running one keeps serving."""
    folder = Path(body.folder) if body is not None and body.folder else None
    carry = body is not None and body.carry_ocm
    return ReloadDrafterResponse(**await state.reload_head(folder, carry_ocm=carry))
