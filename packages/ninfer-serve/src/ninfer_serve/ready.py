"""The announcement that ninfer-serve is ready: where it listens and a curl line to paste.

Ready takes two things that happen on different threads in either order: uvicorn binding the
socket (event loop) and the model finishing loading (engine thread). `Readiness` is told about
each and announces once, when the second arrives, so the curl line it prints works at once.
"""

from __future__ import annotations

import json
import logging
import shlex
import threading
from collections.abc import Callable

log = logging.getLogger("ninfer_serve")

TRY_MESSAGE = "Write one sentence about the sea."
TRY_MAX_TOKENS = 32  # random weights rarely stop by themselves


def base_url(host: str, port: int) -> str:
    """The URL a client on this machine uses (a wildcard bind is reached on loopback)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def try_request(model: str) -> dict:
    """A small chat request that shows a visible answer (thinking off, bounded length)."""
    return {"model": model, "messages": [{"role": "user", "content": TRY_MESSAGE}],
            "max_tokens": TRY_MAX_TOKENS, "chat_template_kwargs": {"enable_thinking": False}}


def curl_command(url: str, model: str, api_key: bool = False) -> str:
    """A shell line that sends `try_request` to the server at `url`. The key is never printed:
    with one, the line reads it from $NINFER_API_KEY (the variable --api-key also reads)."""
    parts = [f"curl -sS {shlex.quote(url + '/v1/chat/completions')}",
             "-H 'Content-Type: application/json'"]
    if api_key:
        parts.append('-H "Authorization: Bearer $NINFER_API_KEY"')
    parts.append(f"-d {shlex.quote(json.dumps(try_request(model)))}")
    return " ".join(parts)


class Readiness:
    def __init__(self, host: str, model: str, api_key: bool,
                 announce: Callable[[str], None] = log.info) -> None:
        self._host = host
        self._model = model
        self._api_key = api_key
        self._announce = announce
        self._lock = threading.Lock()
        self._port: int | None = None
        self._loaded = False

    def listening(self, port: int) -> None:
        with self._lock:
            self._port = port
            ready = self._loaded
        if ready:
            self._ready(port)

    def loaded(self) -> None:
        with self._lock:
            self._loaded = True
            port = self._port
        if port is not None:
            self._ready(port)

    def _ready(self, port: int) -> None:
        url = base_url(self._host, port)
        self._announce(f"ready: serving {self._model!r} at {url}/v1; try:\n"
                       f"  {curl_command(url, self._model, self._api_key)}")
