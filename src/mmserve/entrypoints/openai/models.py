"""Models: GET /v1/models, the one model this server serves (under its served name).

Role: the model card (its served name, the checkpoint it is, its context length).
What it does not know: the engine behind the client, generation, authentication.
"""

from __future__ import annotations

import time
from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field

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

    @router.get("/models")
    async def models() -> ModelList:
        root = serving.client.frontend.config.model
        return ModelList(data=[ModelCard(id=serving.config.served_model_name, root=root,
                                         max_model_len=serving.max_model_len)])

    return router
