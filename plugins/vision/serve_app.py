"""The image endpoints of ``crosstrain serve`` on a ``classify`` or ``detect`` run: ``POST /v1/images/classify``
(top-k classes with softmax scores and class names) and ``POST /v1/images/detect`` (boxes, labels, scores), plus
``/health`` and ``/v1/models``. Images come base64-encoded in JSON (``{"images": ["<base64>", ...]}``, data URLs
accepted) or as multipart files (field ``images``). Refusals are 4xx with the OpenAI error body the language-model
server answers with (:class:`~crosstrain.plugins.serve.protocol.APIError`)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import threading
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from crosstrain.plugins.serve.handlers import add_error_handlers
from crosstrain.plugins.serve.protocol import APIError, parse

#: the most images one request may carry
MAX_IMAGES = 512


class ImagesBody(BaseModel):
    """A JSON request: base64 images (or data URLs), ``top_k`` (classify), the served ``model`` name (optional)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    images: list[str] = Field(min_length=1, max_length=MAX_IMAGES)
    top_k: int = Field(default=5, ge=1)
    model: str | None = None


def _b64(item: str, i: int) -> bytes:
    data = item.split(",", 1)[1] if item.startswith("data:") else item
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"images.{i} is not base64; send the image file's bytes base64-encoded",
                       param="images") from None


async def _read(request: Request, name: str) -> tuple[list[bytes], int]:
    """The request's encoded images and ``top_k``, from JSON or multipart/form-data."""
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        form = await request.form()
        files = [await f.read() for f in form.getlist("images") if hasattr(f, "read")]
        if not files:
            raise APIError(400, "multipart requests carry the images as files in the field 'images'", param="images")
        if len(files) > MAX_IMAGES:
            raise APIError(400, f"at most {MAX_IMAGES} images per request; split the request", param="images")
        raw_k = form.get("top_k", "5")
        try:
            k = int(str(raw_k))
        except ValueError:
            raise APIError(400, f"top_k must be an integer >= 1, got {raw_k!r}", param="top_k") from None
        if k < 1:
            raise APIError(400, f"top_k must be an integer >= 1, got {k}", param="top_k")
        _check_model(str(form["model"]) if "model" in form else None, name)
        return files, k
    body = parse(await request.body(), ImagesBody, request.url.path)
    _check_model(body.model, name)
    return [_b64(item, i) for i, item in enumerate(body.images)], body.top_k


def _check_model(model: str | None, name: str) -> None:
    if model is not None and model != name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {name!r} (GET /v1/models)",
                       param="model", code="model_not_found")


def create_image_app(name: str, manager: Any) -> FastAPI:
    """The app serving ``manager.current`` (an :class:`~crosstrain.plugins.vision.serve.ImageVersion`); a version
    swapped in by ``--watch`` answers the requests that arrive after the swap."""
    from crosstrain.plugins.vision.load import decode_image
    from crosstrain.plugins.vision.predict import classify, detect

    app = FastAPI(title="crosstrain serve (images)", docs_url=None, redoc_url=None, openapi_url=None)
    lock = threading.Lock()  # one forward at a time: torch already uses every core for one batch

    add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": name, **manager.current.describe(), "events": list(manager.events)[-10:]}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        version = manager.current
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(version.loaded_at),
                                            "owned_by": "crosstrain", **version.describe()}]}

    async def _run(request: Request, task: str) -> JSONResponse:
        version = manager.current  # this request's version, whatever a swap does meanwhile
        if version.model.recipe != task:
            other = "classify" if task == "detect" else "detect"
            raise APIError(404, f"this server serves a {version.model.recipe} model; POST /v1/images/{other}",
                           code="wrong_endpoint")
        encoded, k = await _read(request, name)
        try:
            images = [decode_image(data, version.model.channels) for data in encoded]
        except ValueError as exc:
            raise APIError(400, f"images: {exc}", param="images") from None

        def work() -> list[Any]:
            with lock:
                return classify(version.model, images, k) if task == "classify" else detect(version.model, images)

        try:
            results = await asyncio.to_thread(work)
        except ValueError as exc:  # a size the model does not take
            raise APIError(400, f"images: {exc}", param="images") from None
        key = "top_k" if task == "classify" else "detections"
        return JSONResponse({"object": "list", "model": name, "created": int(time.time()),
                             "version": version.number, "step": version.model.step,
                             "data": [{"index": i, key: r} for i, r in enumerate(results)]})

    @app.post("/v1/images/classify")
    async def classify_endpoint(request: Request) -> JSONResponse:
        return await _run(request, "classify")

    @app.post("/v1/images/detect")
    async def detect_endpoint(request: Request) -> JSONResponse:
        return await _run(request, "detect")

    return app
