"""How both servers answer a refusal: an :class:`~crosstrain.plugins.serve.protocol.APIError` raised by a route, and
Starlette's own HTTP errors (an unknown path, a wrong method), as a JSON body in OpenAI's error format with the
error's status, so clients such as the openai SDK read every refusal the same way."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from crosstrain.plugins.serve.protocol import APIError


def add_error_handlers(app: FastAPI) -> None:
    """Answer ``APIError`` and Starlette's ``HTTPException`` on ``app`` with OpenAI's error body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)
