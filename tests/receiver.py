"""A loopback HTTP receiver for alerts: records every request body (JSON when it parses)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    """What arrived: one dict per request ({"path", "body"}), the body parsed as JSON when it is JSON."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.received: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def add(self, path: str, raw: bytes) -> None:
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = raw.decode(errors="replace")
        with self._lock:
            self.received.append({"path": path, "body": body})

    def wait_for(self, match: Callable[[Any], bool], timeout: float = 60) -> Any:
        """The first body that `match` accepts; AssertionError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                for item in self.received:
                    if match(item["body"]):
                        return item["body"]
            time.sleep(0.2)
        raise AssertionError(f"no matching request within {timeout} s; received: {self.received}")


@contextmanager
def receiver() -> Iterator[Receiver]:
    """Start a receiver on 127.0.0.1 (a free port); stopped on exit."""
    holder: list[Receiver] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            holder[0].add(self.path, raw)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder.append(Receiver(f"http://127.0.0.1:{server.server_address[1]}/hook"))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield holder[0]
    finally:
        server.shutdown()
        server.server_close()
