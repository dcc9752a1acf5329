"""A loopback HTTP proxy in front of an S3 server (moto), for tests of sources in a store: it counts what the client
asks (GET, ranged GET, HEAD, LIST, PUT and the bytes sent back) and injects faults (an S3 ``503 SlowDown``).

Standard library only (ThreadingHTTPServer on 127.0.0.1, a free port); each request is forwarded whole to the
server behind it and its answer sent back whole, with its own Content-Length, so keep-alive clients work.
"""

from __future__ import annotations

import http.client
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}


@dataclass
class Proxy:
    """The counts, the faults to inject and the server; `start()` serves it, `url` is what a client is aimed at."""

    upstream: str  # host:port of the S3 server behind
    counts: Counter = field(default_factory=Counter)
    bytes_out: int = 0
    #: Requests still to answer ``503 SlowDown`` (for GETs of an object whose key holds `fault_match`).
    slow_downs: int = 0
    fault_match: str = ""
    faults_sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    def start(self) -> str:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(0.05,), name="s3-proxy", daemon=True).start()
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def reset(self) -> None:
        with self.lock:
            self.counts.clear()
            self.bytes_out = 0

    def slow_down(self, times: int, match: str) -> None:
        """Answer the next `times` GETs of an object whose key holds `match` with ``503 SlowDown``."""
        with self.lock:
            self.slow_downs, self.fault_match = times, match


def kind_of(method: str, path: str) -> str:
    """What an S3 request is: LIST (a GET of a bucket), GET_RANGE / GET (of an object), HEAD, PUT, ..."""
    url = urlsplit(path)
    query = parse_qs(url.query, keep_blank_values=True)
    is_bucket = url.path.strip("/").count("/") == 0
    if method == "GET" and (is_bucket or "list-type" in query):
        return "LIST"
    return method


def _handler_for(proxy: Proxy) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        pass

    Handler.proxy = proxy
    return Handler


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    proxy: Proxy

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's signature
        return None

    def do_GET(self) -> None:
        self._forward("GET")

    def do_HEAD(self) -> None:
        self._forward("HEAD")

    def do_PUT(self) -> None:
        self._forward("PUT")

    def do_POST(self) -> None:
        self._forward("POST")

    def do_DELETE(self) -> None:
        self._forward("DELETE")

    def _forward(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        kind = kind_of(method, self.path)
        if kind == "GET" and "Range" in self.headers:
            kind = "GET_RANGE"
        with self.proxy.lock:
            self.proxy.counts[kind] += 1
            fault = kind.startswith("GET") and self.proxy.slow_downs > 0 and self.proxy.fault_match in self.path
            if fault:
                self.proxy.slow_downs -= 1
                self.proxy.faults_sent += 1
        if fault:
            self._send(503, [("Content-Type", "application/xml")], SLOW_DOWN, method)
            return
        conn = http.client.HTTPConnection(self.proxy.upstream, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            conn.request(method, self.path, body=body or None, headers=headers)
            answer = conn.getresponse()
            data = answer.read()
            keep = _HOP - {"content-length"} if method == "HEAD" else _HOP
            sent = [(k, v) for k, v in answer.getheaders() if k.lower() not in keep]
        finally:
            conn.close()
        with self.proxy.lock:
            self.proxy.bytes_out += len(data)
        self._send(answer.status, sent, data, method)

    def _send(self, status: int, headers: list[tuple[str, str]], data: bytes, method: str) -> None:
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        if method != "HEAD":  # a HEAD's answer keeps the object's length, sent by the server behind
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(data)
