"""Cross-origin requests from browsers (vLLM's --allowed-origins, --allowed-methods,
--allowed-headers, --allow-credentials), answered by Starlette's CORSMiddleware.

A web page on another origin (a chat UI at http://localhost:3000 calling the API at :8000)
sends a preflight OPTIONS before each JSON POST; without CORS headers the browser stops there.
vLLM allows every origin by default. pdserve allows none until told which: with "*", any web
page a user opens can drive a server on their private network that has no API key, through
their browser. Off, the middleware is not in the app at all (nothing per request).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware


@dataclass(frozen=True)
class CorsSettings:
    allowed_origins: tuple[str, ...] = ()  # () : no cross-origin request is allowed
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        if self.allow_credentials and "*" in self.allowed_origins:
            # Starlette would then echo any page's origin with credentials allowed: every site
            # could call the API as the user. Browsers refuse "*" with credentials for that reason.
            raise ValueError("allow_credentials: name the allowed origins; not with '*' (any web page)")


def string_list(name: str, value: Any) -> tuple[str, ...]:
    """A setting's list of strings, from a YAML list, a JSON list (vLLM's flag form,
    `--allowed-origins '["https://a.example"]'`), or one plain string."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{name}: not a JSON list of strings: {e}") from None
        else:
            value = [text]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{name}: a list of non-empty strings, got {value!r}"[:300])
    return tuple(value)


def add_cors(app: FastAPI, cors: CorsSettings) -> None:
    """Answer preflights and mark responses for the allowed origins (nothing when none is).
    Call it after the app's other middleware: outermost, so a refusal (a 401 for a missing
    key) carries the headers too and the page can read it, and a preflight (which carries no
    key) is answered before the key is checked."""
    if not cors.allowed_origins:
        return
    app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                       allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers),
                       allow_credentials=cors.allow_credentials)
