"""ASGI access log: one line per HTTP request (``lockstep serve --access-log``)."""

from __future__ import annotations

import sys
import time
from datetime import datetime, timezone

import msgspec

_JSON = msgspec.json.Encoder()


class AccessLog:
    """ASGI middleware: one line per HTTP request, written once it has ended, to ``out``
    (stdout by default): client, request line, status, body bytes, seconds. A request whose
    client went away before a response started is logged with status 499."""

    def __init__(self, app, out=None, *, json_lines: bool = False):
        self.app, self.out, self.json_lines = app, out, json_lines  # json_lines: one JSON object a line

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status, size = time.perf_counter(), 499, 0

        async def sending(message) -> None:
            nonlocal status, size
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                size += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            host, port = scope.get("client") or ("-", 0)
            path = scope["path"] + (f"?{scope['query_string'].decode('latin-1')}" if scope.get("query_string") else "")
            seconds = time.perf_counter() - start
            if self.json_lines:
                line = _JSON.encode({"event": "access", "client": f"{host}:{port}", "method": scope["method"],
                                     "path": path, "status": status, "bytes": size, "duration_s": round(seconds, 6),
                                     "level": "info",  # as the structlog lines are keyed and stamped
                                     "timestamp": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")}
                                    ).decode()
            else:
                line = (f'{host}:{port} - "{scope["method"]} {path} HTTP/{scope.get("http_version", "1.1")}" '
                        f"{status} {size} {seconds:.3f}s")
            print(line, file=self.out or sys.stdout, flush=True)
