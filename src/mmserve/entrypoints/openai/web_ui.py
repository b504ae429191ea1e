"""The built-in web chat: a single page at `/`, its static files, and the demo picture endpoint.

Role: serve the page (`/`), what it needs to know of the server (`/web-ui/config.json`: whether a key is
needed, whether the demo model is served, which media the served model takes) and its
assets (`/web-ui/<file>`, a fixed list: nothing else on disk is reachable) from
`mmserve/assets/web_ui/` as they ship in the package — no build step, nothing fetched at run time.
When the bundled demo model is served, `GET /demo/sample` draws a shapes picture with the demo task's
generator and returns it with a question and the generator's answer. None of these routes
needs the API key: the page holds no secret (the user types the key into it), and a generated picture
is harmless. The page talks to `/v1/chat/completions` like any other client.

What it does not know: the engine, the OpenAI routes, authentication, models other than by the flag
that says the demo model is served and the media kinds the app says it takes.
"""

from __future__ import annotations

import base64
import io
import secrets
from collections.abc import Sequence
from pathlib import Path

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import FileResponse
from pydantic import BaseModel

from mmserve.demo import shapes

WEB_UI_DIR = Path(__file__).resolve().parents[2] / "assets" / "web_ui"
# the files the page loads, with their media types: a name not listed here is a 404
ASSET_MEDIA_TYPES = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
# held-out seeds only: the demo model never saw these pictures
DEMO_SEED_LIMIT = shapes.TRAIN_SEED_BASE
DEMO_INDEX_LIMIT = 1_000_000


class DemoSample(BaseModel):
    """One shapes sample: its pictures (PNG data URIs), the question, the generator's answer, and the
    (seed, index, question_type) that rebuild it with `mmserve.demo.shapes.make_sample`."""

    images: list[str]
    question: str
    answer: str
    seed: int
    index: int
    question_type: str


def _png_data_uri(image: object) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")  # type: ignore[attr-defined]  (a PIL image)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def demo_sample(seed: int, index: int, question_type: str | None) -> DemoSample:
    """Sample `index` of stream `seed` (question types cycle by index unless one is given)."""
    if question_type is not None and question_type not in shapes.QUESTION_TYPES:
        raise HTTPException(400, f"unknown question_type {question_type!r}; expected one of "
                                 f"{', '.join(shapes.QUESTION_TYPES)}")
    sample = shapes.make_sample(seed, index, question_type)
    return DemoSample(images=[_png_data_uri(image) for image in sample.images], question=sample.question,
                      answer=sample.answer, seed=seed, index=index, question_type=sample.question_type)


class WebUIConfig(BaseModel):
    """What the page needs to know about the server before its first request."""

    demo_model: bool  # `/demo/sample` exists: show the "draw a shapes picture" button
    api_key_required: bool  # show the API key field
    # the media kinds a request may carry ("image", "video", "audio"): the model's, less those
    # --limit-mm-per-prompt sets to 0; "audio" in it: show the audio file and microphone buttons
    input_modalities: list[str]


def web_ui_router(demo_model: bool, api_key_required: bool, input_modalities: Sequence[str] = ()) -> APIRouter:
    """`/`, `/web-ui/config.json` and `/web-ui/<file>`; with `demo_model`, also `/demo/sample`.
    `input_modalities`: the media kinds the served model takes, as the page is told."""
    router = APIRouter(include_in_schema=False)
    page_config = WebUIConfig(demo_model=demo_model, api_key_required=api_key_required,
                              input_modalities=list(input_modalities))

    @router.get("/")
    async def index() -> FileResponse:
        # no-cache: a page left open across a server upgrade revalidates instead of running stale code
        return FileResponse(WEB_UI_DIR / "index.html", media_type="text/html; charset=utf-8",
                            headers={"Cache-Control": "no-cache"})

    @router.get("/web-ui/config.json")
    async def config() -> WebUIConfig:
        return page_config

    @router.get("/web-ui/{name}")
    async def asset(name: str) -> FileResponse:
        media_type = ASSET_MEDIA_TYPES.get(name)
        if media_type is None:
            raise HTTPException(404, f"no web UI file named {name!r}")
        return FileResponse(WEB_UI_DIR / name, media_type=media_type, headers={"Cache-Control": "no-cache"})

    if demo_model:
        @router.get("/demo/sample")
        def sample(seed: int | None = Query(None, ge=0, lt=DEMO_SEED_LIMIT),
                   index: int | None = Query(None, ge=0, lt=DEMO_INDEX_LIMIT),
                   question_type: str | None = None) -> DemoSample:
            """A shapes picture to ask the demo model about; random unless `seed` and `index` are given.
            A sync route: drawing and PNG-encoding run in FastAPI's thread pool, off the event loop."""
            return demo_sample(secrets.randbelow(DEMO_SEED_LIMIT) if seed is None else seed,
                               secrets.randbelow(DEMO_INDEX_LIMIT) if index is None else index, question_type)

    return router
