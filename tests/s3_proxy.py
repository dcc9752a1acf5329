"""A loopback HTTP proxy in front of an S3 server (moto), for tests of sources in a store: it counts what the client
asks (GET, ranged GET, HEAD, LIST, PUT and the bytes sent back) and injects faults in GETs of objects (or PUTs): an S3
``503 SlowDown``, a reset connection (the socket closed with no answer), a short range answer (a 206 with fewer bytes
than the Range asked, its Content-Length the short body's), a lost answer (forwarded, then the connection reset); or
refuses everything, or every write (``403 AccessDenied``).

The proxy is standard library only (ThreadingHTTPServer on 127.0.0.1, a free port); each request is forwarded whole
to the server behind it and its answer sent back whole, with its own Content-Length, so keep-alive clients work.
`loopback_s3` starts moto's server behind one, makes a bucket and aims this process's AWS chain at it (the tests
and the store benches share it).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
ACCESS_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>'
)
#: The faults `fault` injects (LOST: the request reaches the store, then the connection is reset: its answer is lost).
SLOW_DOWN_FAULT, RESET, SHORT, LOST = "slow_down", "reset", "short", "lost"
SHORT_KEEPS = 256  # the bytes a short answer keeps, at most
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}


@dataclass
class Proxy:
    """The counts, the faults to inject and the server; `start()` serves it, `url` is what a client is aimed at."""

    upstream: str  # host:port of the S3 server behind
    counts: Counter = field(default_factory=Counter)
    bytes_out: int = 0
    #: The faults still to inject, in order, each in a request of `fault_kinds` (a GET of an object, unless told)
    #: whose key holds `fault_match` (a short answer waits for a ranged GET).
    faults: deque = field(default_factory=deque)
    fault_match: str = ""
    fault_kinds: tuple[str, ...] = ("GET", "GET_RANGE")
    faults_sent: int = 0
    refuse: bool = False  # every request answered 403 AccessDenied
    #: Every request since the last reset, in order: (its kind, its path with the query).
    requests: list = field(default_factory=list)
    #: PUTs, POSTs and DELETEs of a key holding this ("": every one) answered 403 AccessDenied, counted as REFUSED
    #: (reads pass: no permission to write there); None: none.
    refuse_writes: str | None = None
    #: CPU seconds the proxy's own threads spent forwarding (`time.thread_time`): test machinery a real store's
    #: client does not run (the benches print it beside the build's wall time).
    cpu_seconds: float = 0.0
    #: Seconds each PUT whose key holds `put_delay_match` waits before it is forwarded (a slow store, for tests).
    put_delay: float = 0.0
    put_delay_match: str = ""
    #: Seconds every request waits before it is forwarded: a far store's round trip (tests, `bench/`).
    latency: float = 0.0
    #: Requests being answered now, and the most at once since the last reset (a client asking several at once).
    in_flight: int = 0
    most_in_flight: int = 0
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
            self.requests.clear()
            self.bytes_out = 0
            self.cpu_seconds = 0.0
            self.most_in_flight = self.in_flight

    def slow_down(self, times: int, match: str) -> None:
        """Answer the next `times` GETs of an object whose key holds `match` with ``503 SlowDown``."""
        self.fault([SLOW_DOWN_FAULT] * times, match)

    def fault(self, faults: list[str], match: str, kinds: tuple[str, ...] = ("GET", "GET_RANGE")) -> None:
        """Inject `faults` (`SLOW_DOWN_FAULT`, `RESET`, `SHORT`, `LOST`), in order, in the next requests of `kinds`
        (GETs of an object, or ``("PUT",)``: a write) whose key holds `match`."""
        with self.lock:
            self.faults, self.fault_match, self.fault_kinds = deque(faults), match, kinds

    def next_fault(self, kind: str, path: str) -> str | None:
        """The fault to inject in this request (taken off the queue), or None."""
        with self.lock:
            if not (kind in self.fault_kinds and self.faults and self.fault_match in path):
                return None
            if self.faults[0] == SHORT and kind != "GET_RANGE":
                return None
            self.faults_sent += 1
            return self.faults.popleft()


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
    answering = False  # this request counted in flight, its answer not yet sent

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
        with self.proxy.lock:
            self.proxy.in_flight += 1
            self.proxy.most_in_flight = max(self.proxy.most_in_flight, self.proxy.in_flight)
        self.answering = True
        start = time.thread_time()
        try:
            if self.proxy.latency:
                time.sleep(self.proxy.latency)
            self._forward_timed(method)
        finally:
            self._answered()
            with self.proxy.lock:
                self.proxy.cpu_seconds += time.thread_time() - start

    def _answered(self) -> None:
        """The request is no longer in flight: counted off before its answer is sent (once the client has it, it may
        send its next request while this thread still winds up, which is not two at once)."""
        if self.answering:
            self.answering = False
            with self.proxy.lock:
                self.proxy.in_flight -= 1

    def _forward_timed(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        kind = kind_of(method, self.path)
        if kind == "GET" and "Range" in self.headers:
            kind = "GET_RANGE"
        with self.proxy.lock:
            self.proxy.counts[kind] += 1
            self.proxy.requests.append((kind, self.path))
        if self.proxy.refuse or self._write_refused(method):
            self._send(403, [("Content-Type", "application/xml")], ACCESS_DENIED, method)
            return
        fault = self.proxy.next_fault(kind, self.path)
        if fault == SLOW_DOWN_FAULT:
            self._send(503, [("Content-Type", "application/xml")], SLOW_DOWN, method)
            return
        if fault == RESET:  # no answer at all: the client sees its connection closed
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if method == "PUT" and self.proxy.put_delay and self.proxy.put_delay_match in self.path:
            time.sleep(self.proxy.put_delay)
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
        if fault == LOST:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if fault == SHORT and answer.status == 206 and len(data) > 1:
            data, sent = _short(data, sent)
        with self.proxy.lock:
            self.proxy.bytes_out += len(data)
        self._send(answer.status, sent, data, method)

    def _write_refused(self, method: str) -> bool:
        refused = self.proxy.refuse_writes
        if refused is None or method not in ("PUT", "POST", "DELETE") or refused not in urlsplit(self.path).path:
            return False
        with self.proxy.lock:
            self.proxy.counts["REFUSED"] += 1
        return True

    def _send(self, status: int, headers: list[tuple[str, str]], data: bytes, method: str) -> None:
        self._answered()
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        if method != "HEAD":  # a HEAD's answer keeps the object's length, sent by the server behind
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(data)


def _short(data: bytes, headers: list[tuple[str, str]]) -> tuple[bytes, list[tuple[str, str]]]:
    """The first bytes of a range answer (half, at most `SHORT_KEEPS`: less than a tar header, so that a reader that
    asked for little still gets less), its Content-Range saying so (its Content-Length is set on sending)."""
    kept = data[: min(len(data) // 2, SHORT_KEEPS)]
    fixed = []
    for name, value in headers:
        if name.lower() == "content-range" and (found := re.match(r"bytes (\d+)-\d+/(\S+)", value)):
            start = int(found[1])
            value = f"bytes {start}-{start + len(kept) - 1}/{found[2]}"
        fixed.append((name, value))
    return kept, fixed


#: The AWS settings a loopback store clears, so that no profile, session or S3-only endpoint of the user leaks in.
UNSET_AWS = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3")


@dataclass
class LoopbackS3:
    """A running loopback store: the counting proxy, moto's own URL behind it, the AWS settings aimed at the proxy."""

    proxy: Proxy
    direct: str
    env: dict[str, str]
    moto_pid: int | None = None  # moto's own process (``moto="process"``), whose CPU `moto_cpu_seconds` reads

    def moto_cpu_seconds(self) -> float | None:
        """CPU seconds (user + system) moto's process has used so far; None when moto runs in this process."""
        if self.moto_pid is None:
            return None
        fields = Path(f"/proc/{self.moto_pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)

    def objects(self, bucket: str, prefix: str) -> dict[str, bytes]:
        """Every object below ``s3://BUCKET/PREFIX/`` (key relative to the prefix → bytes), read past the proxy,
        leaving out what `tests.conftest.tree_hashes` leaves out of a folder (the writer lock, reports/)."""
        import boto3  # noqa: PLC0415 - the test environment's, imported with the store

        client, found = boto3.client("s3", endpoint_url=self.direct), {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
            for item in page.get("Contents", []):
                rel = item["Key"][len(prefix) + 1 :]
                if rel != ".latentforge.lock" and rel.split("/")[0] != "reports":
                    found[rel] = client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
        return dict(sorted(found.items()))


def clear_store_clients() -> None:
    """fsspec keeps one S3 client per store and options: another loopback server is another endpoint."""
    import s3fs  # noqa: PLC0415 - a store's library, as the sources and OUT import it

    s3fs.S3FileSystem.clear_instance_cache()


@contextlib.contextmanager
def _moto(where: str) -> Iterator[tuple[str, int, int | None]]:
    """moto's server on 127.0.0.1, a thread of this process or (``"process"``) its own process: (host, port, its
    PID or None)."""
    if where == "process":
        from tests.procs import free_port, stop_group, wait_answers  # noqa: PLC0415 - only a process needs them

        port = free_port()
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_answers(f"http://127.0.0.1:{port}/moto-api/", proc, "moto server", timeout=30)
            yield "127.0.0.1", port, proc.pid
        finally:
            stop_group(proc, timeout=10)
        return
    from moto.server import ThreadedMotoServer  # noqa: PLC0415

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield host, port, None
    finally:
        server.stop()


@contextlib.contextmanager
def loopback_s3(
    bucket: str, access_key: str, secret_key: str, home: Path, moto: str = "thread"
) -> Iterator[LoopbackS3]:
    """moto's server on 127.0.0.1 (a thread of this process, or with ``moto="process"`` its own process, whose CPU
    is then told apart) behind a counting `Proxy`, `bucket` made, and this process's AWS chain aimed at the proxy
    (`home`: where the empty config and credentials files are named) until the block ends."""
    with _moto(moto) as (host, port, pid), _proxied(bucket, access_key, secret_key, home, host, port) as store:
        store.moto_pid = pid
        yield store


@contextlib.contextmanager
def _proxied(bucket: str, access_key: str, secret_key: str, home: Path, host: str, port: int) -> Iterator[LoopbackS3]:
    import boto3  # noqa: PLC0415 - the test environment's

    proxy = Proxy(upstream=f"{host}:{port}")
    proxy.start()
    env = {
        "AWS_ACCESS_KEY_ID": access_key,
        "AWS_SECRET_ACCESS_KEY": secret_key,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": proxy.url,
        "AWS_CONFIG_FILE": str(home / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    saved = {name: os.environ.get(name) for name in (*env, *UNSET_AWS)}
    for name in UNSET_AWS:
        os.environ.pop(name, None)
    os.environ.update(env)
    clear_store_clients()
    try:
        store = LoopbackS3(proxy, f"http://{host}:{port}", env)
        boto3.client("s3", endpoint_url=store.direct).create_bucket(Bucket=bucket)
        yield store
    finally:
        clear_store_clients()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        proxy.stop()


def module_s3(bucket: str, access_key: str, secret_key: str) -> Any:
    """A module-scoped fixture of `loopback_s3` (``s3 = module_s3(BUCKET, KEY, SECRET)`` in a test module): moto's
    server on 127.0.0.1 behind the counting proxy, the AWS chain aimed at the proxy for the module."""
    import pytest  # noqa: PLC0415 - the benches import this module without pytest's fixtures

    @pytest.fixture(scope="module", name="s3")
    def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackS3]:
        with loopback_s3(bucket, access_key, secret_key, tmp_path_factory.mktemp("aws")) as store:
            yield store

    return s3
