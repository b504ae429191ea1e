"""Models: GET /v1/models, the one model this server serves (under its served name), and GET
/v1/models/{id}, its card by any name the server answers to (404 naming the id for any other).

Role: the model card (its served name, the checkpoint it is, its context length).
What it does not know: the engine behind the client, generation, authentication.
"""

from __future__ import annotations

import time
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field

from mmserve.entrypoints.openai.protocol import RequestError
from mmserve.entrypoints.openai.serving import OpenAIServing


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "mmserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def models_router(serving: OpenAIServing) -> APIRouter:
    """The models route (the app mounts it under /v1, behind the API key)."""
    router = APIRouter()

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, root=serving.client.frontend.config.model, max_model_len=serving.max_model_len)

    @router.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[card(serving.config.served_model_name)])

    @router.get("/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        """One model's card (ids may hold slashes: a hub id served under its own name)."""
        if model_id not in serving.model_names:
            raise RequestError(f"The model `{model_id}` does not exist.", status_code=404, type="not_found_error",
                               param="model", code="model_not_found")
        return card(model_id)

    return router
