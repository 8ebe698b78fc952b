"""GET /: the playground page, a single static page that streams from the API and colours every token by
its provenance. Its files ship inside the package (service/api/static); nothing is fetched from elsewhere.

The page itself needs no key (it holds no data); the API calls it makes send the key the user enters.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse

from service.api.deps import State
from service.config import Settings

STATIC = Path(__file__).resolve().parent.parent / "static"
_CONFIG_SLOT = "__CSD_CONFIG__"

router = APIRouter(tags=["playground"], include_in_schema=False)


@cache
def _index_template() -> str:
    return (STATIC / "index.html").read_text(encoding="utf-8")


def page_config(settings: Settings) -> dict:
    """The server's defaults, so the form starts where the server does (and knows the model's name
    without an authenticated call). The drafters it offers come from GET /v1/drafters (the registry)."""
    return {
        "model": settings.served_model_name or settings.model,
        "method": settings.method.value,
        "drafter": settings.drafter,
        "num_speculative_tokens": settings.num_speculative_tokens,
        "tau": settings.tau,
        "lambda": settings.lambda_,
        "temperature": settings.default_temperature,
        "max_tokens": min(settings.default_max_tokens, settings.max_tokens_cap, 128),
        "max_tokens_cap": settings.max_tokens_cap,
        "auth_required": bool(settings.api_keys),
    }


@router.get("/", response_class=HTMLResponse)
async def index(state: State) -> HTMLResponse:
    # "</" inside a <script> element would end it early; JSON allows the escaped form.
    config = json.dumps(page_config(state.settings)).replace("</", "<\\/")
    return HTMLResponse(
        _index_template().replace(_CONFIG_SLOT, config), headers={"Cache-Control": "no-cache"}
    )


@router.get("/playground/app.js")
async def script() -> FileResponse:
    return FileResponse(
        STATIC / "app.js", media_type="text/javascript", headers={"Cache-Control": "no-cache"}
    )


@router.get("/playground/style.css")
async def style() -> FileResponse:
    return FileResponse(STATIC / "style.css", media_type="text/css", headers={"Cache-Control": "no-cache"})
