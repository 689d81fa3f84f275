"""Who may call ``crosstrain serve``: OpenAI's bearer-key scheme (clients send ``Authorization: Bearer <key>``,
which the openai SDK's ``api_key`` does; vLLM's ``--api-key`` works the same way). The key comes from the
environment (``CROSSTRAIN_API_KEY``), never the command line, where every local user could read it in ``ps``.
Every ``/v1/`` route needs it; ``/health`` and ``/metrics`` stay open for probes and scrapers, as in vLLM. A server
that listens beyond the loopback interface without a key is refused before it binds."""

from __future__ import annotations

import hmac
import ipaddress
import os
from typing import Any

from crosstrain.errors import ConfigError

#: the environment variable that holds the key
ENV = "CROSSTRAIN_API_KEY"


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def api_key_for(host: str, environ: dict[str, str] | None = None) -> str | None:
    """The key from ``CROSSTRAIN_API_KEY`` (None when unset); ConfigError for a non-loopback ``host`` without one."""
    key = (os.environ if environ is None else environ).get(ENV) or None
    if key is None and not is_loopback(host):
        raise ConfigError(f"--host {host} accepts connections from other machines, and no key authenticates them; "
                          f"set {ENV} (clients send it as their OpenAI api_key) or listen on 127.0.0.1")
    return key


def require_api_key(app: Any, key: str | None) -> None:
    """Answer every ``/v1/`` request without ``Authorization: Bearer <key>`` with OpenAI's 401 body (``key`` None:
    nothing to check, the server listens on loopback only)."""
    if key is None:
        return
    from fastapi import Request
    from fastapi.responses import JSONResponse

    from crosstrain.plugins.serve.protocol import APIError

    expected = f"Bearer {key}".encode()

    @app.middleware("http")
    async def _authenticate(request: Request, call_next: Any) -> Any:
        sent = request.headers.get("authorization", "").encode()
        if request.url.path.startswith("/v1/") and not hmac.compare_digest(sent, expected):  # constant time
            error = APIError(401, f"missing or wrong API key; send the server's {ENV} as the bearer token "
                                  "(the openai SDK's api_key)", code="invalid_api_key")
            return JSONResponse(error.body(), status_code=401)
        return await call_next(request)
