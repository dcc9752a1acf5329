"""A loopback fake of the Hugging Face Hub, for tests of the Hub store (import the fixtures you use).

Standard library only (ThreadingHTTPServer on 127.0.0.1, a free port). It serves the endpoints the real
`huggingface_hub` 2.4 client calls to create a dataset repo, upload (preupload, LFS batch, PUT, verify,
ndjson commit, validate-yaml), list (revision info, recursive tree with Link paging, paths-info) and
download (resolve, HEAD and GET, a Range answered 206), with the xet transport disabled (`HF_HUB_DISABLE_XET=1`:
xet uploads go through the compiled `hf_xet` client to a separate content-addressed store, which this fake does
not speak; with xet off the client falls back to the LFS batch + PUT path served here).

Mirrored Hub rules: a new repo starts with an initial commit holding `.gitattributes`; a file is LFS when it is
binary (a NUL byte or invalid UTF-8 in its first 512 bytes) or ≥ 10 MiB, regular otherwise, and empty files are
regular; a commit with a `parentCommit` that is not the branch head fails with 412 ("A commit has happened
since"); errors carry `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound). Files live in memory.

A model repo is served by the same routes under ``/api/models/`` and ``/{repo}/resolve/`` (read only).

Every request is logged (method, path, bytes received, status) so tests can count what was sent; a test can
make the Nth commit fail with a 4xx (`fail_commit`), drop the connection before (`drop_commit`) or after
applying it (`lose_commit_response`), answer the next downloads with given statuses (`download_faults`), and
commit as "someone else" (`commit`, `delete`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pytest
import yaml

LFS_THRESHOLD = 10 * 1024 * 1024
GITATTRIBUTES = b"*.pt filter=lfs diff=lfs merge=lfs -text\n*.tar filter=lfs diff=lfs merge=lfs -text\n"
_REPO = r"(?P<repo>[^/]+/[^/]+?)"
_REV = r"(?P<rev>[^/]+)"


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def is_binary(sample: bytes) -> bool:
    if b"\0" in sample:
        return True
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start < len(sample) - 4  # a multi-byte character cut at the 512-byte edge is still text
    return False


@dataclass(frozen=True)
class Blob:
    """One file in a commit's tree."""

    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def pointer(self) -> bytes:
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.data)}\n".encode()

    @property
    def oid(self) -> str:
        """The git blob id: of the content (regular) or of the LFS pointer."""
        return git_sha1(self.pointer if self.lfs else self.data)

    def entry(self, path: str, *, expand: bool, commit: str) -> dict[str, Any]:
        item: dict[str, Any] = {"type": "file", "path": path, "size": len(self.data), "oid": self.oid}
        if self.lfs:
            item["lfs"] = {"oid": self.sha256, "size": len(self.data), "pointerSize": len(self.pointer)}
        if expand:
            item["lastCommit"] = {"id": commit, "title": "a commit", "date": "2025-01-01T00:00:00.000Z"}
        return item


@dataclass
class Repo:
    """A dataset repo: commits (oid → tree snapshot), branches (name → head oid), LFS objects (sha256 → bytes)."""

    private: bool
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    lfs: dict[str, bytes] = field(default_factory=dict)

    def resolve(self, rev: str) -> str | None:
        return self.branches.get(rev) or (rev if rev in self.commits else None)


@dataclass(frozen=True)
class Request:
    """One request as the fake saw it."""

    method: str
    path: str
    bytes_in: int
    status: int
    authorized: bool


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class FakeHub:
    """The in-memory Hub state, its request log and fault injection; `start()` serves it on 127.0.0.1."""

    def __init__(self, *, token: str | None = None, page_size: int | None = None) -> None:
        self.token = token  # when set, every request must carry "Authorization: Bearer <token>"
        self.page_size = page_size  # None: the Hub's own (1000 entries, 50 with expand)
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self.created: list[dict[str, Any]] = []  # create_repo payloads
        self._faults: dict[int, tuple[str, int]] = {}  # commit number (1-based) → (kind, status)
        self._download_faults: list[int] = []  # the statuses the next matching downloads answer, in turn
        self._download_match = ""
        self.commit_delay = 0.0  # seconds each commit takes (a slow Hub: lets a test kill an upload mid-way)
        self._commits_seen = 0
        self._counter = 0
        self.lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> str:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fakehub", daemon=True).start()
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the fake first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- what tests look at ----------------------------------------------------------------------------------
    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        return {path: blob.data for path, blob in repo.commits[repo.branches[revision]].items()}

    def blobs(self, repo_id: str, revision: str = "main") -> dict[str, Blob]:
        repo = self.repos[repo_id]
        return dict(repo.commits[repo.branches[revision]])

    def head(self, repo_id: str, revision: str = "main") -> str:
        return self.repos[repo_id].branches[revision]

    def count(self, method: str, pattern: str) -> int:
        return sum(1 for r in self.requests if r.method == method and re.search(pattern, r.path))

    def put_bytes(self) -> int:
        """Bytes received by LFS PUTs (file content sent to the store)."""
        return sum(r.bytes_in for r in self.requests if r.method == "PUT")

    def commits_made(self, repo_id: str) -> int:
        return len(self.repos[repo_id].commits) - 1  # without the initial commit

    def clear_log(self) -> None:
        with self.lock:
            self.requests.clear()

    # -- fault injection and other writers ------------------------------------------------------------------
    def fail_commit(self, nth: int, status: int = 422) -> None:
        """The `nth` commit request from now answers `status` and changes nothing (use a 4xx: 5xx are retried)."""
        self._faults[self._commits_seen + nth] = ("fail", status)

    def drop_commit(self, nth: int) -> None:
        """The `nth` commit request from now is read, not applied, and the connection closed without an answer."""
        self._faults[self._commits_seen + nth] = ("drop", 0)

    def lose_commit_response(self, nth: int) -> None:
        """The `nth` commit request from now is applied, then the connection closed without an answer."""
        self._faults[self._commits_seen + nth] = ("lose", 0)

    def download_faults(self, statuses: list[int], match: str = "") -> None:
        """The next len(`statuses`) downloads (GET or HEAD of a resolve URL) where the regex `match` is found in
        ``"METHOD PATH"`` answer those statuses in turn (changing nothing); the ones after, as usual."""
        with self.lock:
            self._download_faults, self._download_match = list(statuses), match

    def next_download_fault(self, method: str, path: str) -> int | None:
        if self._download_faults and re.search(self._download_match, f"{method} {path}"):
            return self._download_faults.pop(0)
        return None

    def create(self, repo_id: str, *, private: bool = True) -> None:
        with self.lock:
            repo = Repo(private=private)
            oid = self._new_oid(repo_id)
            repo.commits[oid] = {".gitattributes": Blob(GITATTRIBUTES, lfs=False)}
            repo.branches["main"] = oid
            self.repos[repo_id] = repo

    def commit(
        self, repo_id: str, files: dict[str, bytes], *, delete: tuple[str, ...] = (), branch: str = "main"
    ) -> str:
        """A commit by someone else (not through HTTP): add/replace `files`, delete `delete`; returns its oid."""
        with self.lock:
            repo = self.repos[repo_id]
            tree = dict(repo.commits[repo.branches[branch]])
            for path in delete:
                tree.pop(path)
            for path, data in files.items():
                lfs = bool(data) and (is_binary(data[:512]) or len(data) >= LFS_THRESHOLD)
                if lfs:
                    repo.lfs[hashlib.sha256(data).hexdigest()] = data
                tree[path] = Blob(data, lfs)
            return self._land(repo_id, repo, branch, tree)

    def delete(self, repo_id: str, path: str, branch: str = "main") -> str:
        return self.commit(repo_id, {}, delete=(path,), branch=branch)

    def _new_oid(self, repo_id: str) -> str:
        self._counter += 1
        return hashlib.sha1(f"{repo_id}:{self._counter}".encode(), usedforsecurity=False).hexdigest()

    def _land(self, repo_id: str, repo: Repo, branch: str, tree: dict[str, Blob]) -> str:
        oid = self._new_oid(repo_id)
        repo.commits[oid] = tree
        repo.branches[branch] = oid
        return oid

    # -- endpoint logic (called by the handler under the lock) ----------------------------------------------
    def repo(self, repo_id: str) -> Repo:
        if repo_id not in self.repos:
            raise HubError(404, "Repository not found", "RepoNotFound")
        return self.repos[repo_id]

    def tree_at(self, repo_id: str, rev: str) -> tuple[str, dict[str, Blob]]:
        repo = self.repo(repo_id)
        oid = repo.resolve(unquote(rev))
        if oid is None:
            raise HubError(404, f"Invalid rev id: {unquote(rev)}", "RevisionNotFound")
        return oid, repo.commits[oid]

    def next_commit_fault(self) -> tuple[str, int] | None:
        self._commits_seen += 1
        return self._faults.pop(self._commits_seen, None)

    def apply_commit(self, repo_id: str, rev: str, lines: list[dict[str, Any]]) -> str:
        repo = self.repo(repo_id)
        branch = unquote(rev)
        if branch not in repo.branches:
            raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
        header = next((line["value"] for line in lines if line["key"] == "header"), {})
        parent = header.get("parentCommit")
        if parent is not None and parent != repo.branches[branch]:
            raise HubError(412, "A commit has happened since. Please refresh and try again.")
        tree = dict(repo.commits[repo.branches[branch]])
        for line in lines:
            key, value = line["key"], line["value"]
            if key == "file":
                tree[value["path"]] = Blob(base64.b64decode(value["content"]), lfs=False)
            elif key == "lfsFile":
                if value["oid"] not in repo.lfs:
                    raise HubError(422, f"LFS object {value['oid']} was never uploaded")
                tree[value["path"]] = Blob(repo.lfs[value["oid"]], lfs=True)
            elif key == "deletedFile":
                if tree.pop(value["path"], None) is None:
                    raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
            elif key == "deletedFolder":
                for path in [p for p in tree if p.startswith(value["path"].rstrip("/") + "/")]:
                    del tree[path]
        return self._land(repo_id, repo, branch, tree)


def tree_entries(tree: dict[str, Blob], prefix: str, *, recursive: bool, expand: bool, commit: str) -> list[dict]:
    """The Hub's tree listing of `prefix` ("" = root): directories then files, sorted, like the real one."""
    head = prefix.rstrip("/") + "/" if prefix else ""
    folders: set[str] = set()
    files: list[dict[str, Any]] = []
    for path in sorted(tree):
        if not path.startswith(head):
            continue
        parts = path[len(head) :].split("/")
        for depth in range(1, len(parts) if recursive else min(2, len(parts))):
            folders.add(head + "/".join(parts[:depth]))
        if recursive or len(parts) == 1:
            files.append(tree[path].entry(path, expand=expand, commit=commit))
    if prefix and not files and not folders and prefix not in tree:
        raise HubError(404, f"{prefix} does not exist", "EntryNotFound")
    dirs = [{"type": "directory", "path": p, "oid": git_sha1(p.encode()), "size": 0} for p in sorted(folders)]
    return dirs + files


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        pass

    Handler.hub = hub
    return Handler


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: FakeHub

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        return None

    def do_GET(self) -> None:
        self._serve("GET")

    def do_HEAD(self) -> None:
        self._serve("HEAD")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    # -- plumbing --------------------------------------------------------------------------------------------
    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                chunk = self.rfile.read(size + 2)[:size]
                if size == 0:
                    break
                chunks.append(chunk)
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _serve(self, method: str) -> None:
        body = self._body()
        authorized = not self.hub.token or self.headers.get("Authorization") == f"Bearer {self.hub.token}"
        status = 200
        try:
            if not authorized and not self.path.startswith("/lfs-"):
                raise HubError(401, "Invalid credentials in Authorization header")
            with self.hub.lock:
                reply = self._route(method, body)
            status = reply[0]  # the status sent (a 206, a 409 answered, not raised), logged as it is
        except HubError as exc:
            status = exc.status
            headers = {"X-Error-Message": exc.message, **({"X-Error-Code": exc.code} if exc.code else {})}
            reply = (status, {"error": exc.message}, headers)
        except (KeyError, ValueError, TypeError) as exc:  # a request the fake cannot read: 400, never a retried 5xx
            status = 400
            reply = (status, {"error": f"fake hub: {type(exc).__name__}: {exc}"}, {})
        except _Drop:
            status = 0
            self.close_connection = True
        finally:
            with self.hub.lock:
                self.hub.requests.append(Request(method, self.path, len(body), status, authorized))
        if status != 0:
            self._reply(method, *reply)

    def _reply(self, method: str, status: int, payload: Any, headers: dict[str, str]) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        if not isinstance(payload, bytes):
            self.send_header("Content-Type", "application/json")
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(data)

    def _route(self, method: str, body: bytes) -> tuple[int, Any, dict[str, str]]:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        for verb, pattern, name in _ROUTES:
            if (verb == method or (verb, method) == ("GET", "HEAD")) and (match := re.fullmatch(pattern, url.path)):
                return getattr(self, name)(body, query, **match.groupdict())
        raise HubError(404, f"no fake route for {method} {url.path}")

    # -- endpoints -------------------------------------------------------------------------------------------
    def create_repo(self, body: bytes, query: dict[str, str]) -> tuple[int, Any, dict[str, str]]:
        payload = json.loads(body)
        repo_id = f"{payload.get('organization')}/{payload['name']}"
        url = {"url": f"{self.hub.url}/datasets/{repo_id}", "name": repo_id}
        self.hub.created.append(payload)
        if repo_id in self.hub.repos:
            return 409, {"error": "You already created this dataset repo", **url}, {}
        self.hub.create(repo_id, private=payload.get("visibility", "private") == "private")
        return 200, url, {}

    def create_branch(self, body: bytes, query: dict[str, str], repo: str, branch: str) -> tuple[int, Any, dict]:
        state = self.hub.repo(repo)
        if unquote(branch) in state.branches:
            return 409, {"error": "Reference already exists"}, {}
        start = (json.loads(body or b"{}") or {}).get("startingPoint") or "main"
        oid, _ = self.hub.tree_at(repo, start)
        state.branches[unquote(branch)] = oid
        return 200, {}, {}

    def revision(self, body: bytes, query: dict[str, str], repo: str, rev: str) -> tuple[int, Any, dict]:
        oid, tree = self.hub.tree_at(repo, rev)
        siblings = [{"rfilename": p, "size": len(b.data)} for p, b in sorted(tree.items())]
        return 200, {"id": repo, "sha": oid, "private": self.hub.repos[repo].private, "siblings": siblings}, {}

    def info(self, body: bytes, query: dict[str, str], repo: str) -> tuple[int, Any, dict]:
        """The repo's info at its main branch (what `HfFileSystem` asks to resolve a path without a revision)."""
        return self.revision(body, query, repo, "main")

    def tree(self, body: bytes, query: dict[str, str], repo: str, rev: str, path: str | None = None) -> tuple:
        oid, tree = self.hub.tree_at(repo, rev)
        recursive, expand = query.get("recursive", "").lower() == "true", query.get("expand", "").lower() == "true"
        entries = tree_entries(tree, unquote(path or ""), recursive=recursive, expand=expand, commit=oid)
        size = self.hub.page_size or (50 if expand else 1000)
        start = int(query.get("cursor", 0))
        headers = {}
        if start + size < len(entries):
            rest = f"recursive={str(recursive).lower()}&expand={str(expand).lower()}&cursor={start + size}"
            headers["Link"] = f'<{self.hub.url}{urlsplit(self.path).path}?{rest}>; rel="next"'
        return 200, entries[start : start + size], headers

    def paths_info(self, body: bytes, query: dict[str, str], repo: str, rev: str) -> tuple[int, Any, dict]:
        oid, tree = self.hub.tree_at(repo, rev)
        form = parse_qs(body.decode())
        expand = form.get("expand", ["false"])[-1].lower() == "true"
        found = [tree[p].entry(p, expand=expand, commit=oid) for p in form.get("paths", []) if p in tree]
        return 200, found, {}

    def preupload(self, body: bytes, query: dict[str, str], repo: str, rev: str) -> tuple[int, Any, dict]:
        _, tree = self.hub.tree_at(repo, rev)
        answers = []
        for item in json.loads(body)["files"]:
            sample = base64.b64decode(item["sample"])
            lfs = item["size"] > 0 and (item["size"] >= LFS_THRESHOLD or is_binary(sample))
            entry = {"path": item["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False}
            if (blob := tree.get(item["path"])) is not None:
                entry["oid"] = blob.sha256 if blob.lfs else blob.oid
            answers.append(entry)
        return 200, {"files": answers, "commitOid": self.hub.tree_at(repo, rev)[0]}, {}

    def lfs_batch(self, body: bytes, query: dict[str, str], repo: str) -> tuple[int, Any, dict[str, str]]:
        state = self.hub.repo(repo)
        objects, seen = [], set()
        for obj in json.loads(body)["objects"]:
            if obj["oid"] in seen:  # one answer an object: the client maps each oid to one of its files, sent once
                continue
            seen.add(obj["oid"])
            item: dict[str, Any] = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in state.lfs:
                where = f"{quote(repo, safe='')}/{obj['oid']}"
                item["actions"] = {
                    "upload": {"href": f"{self.hub.url}/lfs-upload/{where}"},
                    "verify": {"href": f"{self.hub.url}/lfs-verify/{where}"},
                }
            objects.append(item)
        return 200, {"transfer": "basic", "objects": objects}, {"Content-Type": "application/vnd.git-lfs+json"}

    def lfs_upload(self, body: bytes, query: dict[str, str], repo: str, oid: str) -> tuple[int, Any, dict]:
        if hashlib.sha256(body).hexdigest() != oid:
            raise HubError(400, "the content does not match its oid")
        self.hub.repo(unquote(repo)).lfs[oid] = body
        return 200, b"", {"ETag": f'"{oid}"'}

    def lfs_verify(self, body: bytes, query: dict[str, str], repo: str, oid: str) -> tuple[int, Any, dict]:
        stored = self.hub.repo(unquote(repo)).lfs.get(oid)
        if stored is None or len(stored) != json.loads(body)["size"]:
            raise HubError(404, f"LFS object {oid} not found")
        return 200, {"success": True}, {}

    def commit(self, body: bytes, query: dict[str, str], repo: str, rev: str) -> tuple[int, Any, dict]:
        time.sleep(self.hub.commit_delay)
        fault = self.hub.next_commit_fault()
        if fault is not None and fault[0] == "fail":
            raise HubError(fault[1], "commit refused by the fake (fault injection)")
        if fault is not None and fault[0] == "drop":
            raise _Drop
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        oid = self.hub.apply_commit(repo, rev, lines)
        if fault is not None and fault[0] == "lose":
            raise _Drop
        url = f"{self.hub.url}/datasets/{repo}/commit/{oid}"
        return 200, {"success": True, "commitOid": oid, "commitUrl": url, "hookOutput": ""}, {}

    def validate_yaml(self, body: bytes, query: dict[str, str]) -> tuple[int, Any, dict[str, str]]:
        content = json.loads(body)["content"]
        match = re.match(r"^---\n(.*?)\n---\n", content, re.DOTALL)
        try:
            meta = yaml.safe_load(match[1]) if match else {}
        except yaml.YAMLError as exc:
            return 400, {"errors": [{"message": f"invalid YAML: {exc}"}]}, {}
        if not isinstance(meta, dict) or not isinstance(meta.get("license", ""), str):
            return 400, {"errors": [{"message": "metadata must be a mapping with a string license"}]}, {}
        return 200, {"errors": [], "warnings": []}, {}

    def resolve(self, body: bytes, query: dict[str, str], repo: str, rev: str, path: str) -> tuple[int, Any, dict]:
        if (status := self.hub.next_download_fault(self.command, self.path)) is not None:
            raise HubError(status, f"download refused by the fake (fault injection): {status}")
        oid, tree = self.hub.tree_at(repo, rev)
        blob = tree.get(unquote(path))
        if blob is None:
            raise HubError(404, f"{path} does not exist", "EntryNotFound")
        etag = blob.sha256 if blob.lfs else blob.oid
        headers = {"X-Repo-Commit": oid, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"}
        wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if wanted is None:
            return 200, blob.data, headers
        start, end = int(wanted[1]), min(int(wanted[2] or len(blob.data) - 1), len(blob.data) - 1)
        headers["Content-Range"] = f"bytes {start}-{end}/{len(blob.data)}"
        return 206, blob.data[start : end + 1], headers


class _Drop(Exception):
    """Close the connection without an answer."""


_ROUTES: list[tuple[str, str, str]] = [
    ("POST", r"/api/repos/create", "create_repo"),
    ("POST", r"/api/validate-yaml", "validate_yaml"),
    ("POST", rf"/api/datasets/{_REPO}/branch/(?P<branch>[^/]+)", "create_branch"),
    ("GET", rf"/api/datasets/{_REPO}/revision/{_REV}", "revision"),
    ("GET", rf"/api/datasets/{_REPO}", "info"),
    ("GET", rf"/api/datasets/{_REPO}/tree/{_REV}(?:/(?P<path>.+))?", "tree"),
    ("POST", rf"/api/datasets/{_REPO}/paths-info/{_REV}", "paths_info"),
    ("POST", rf"/api/datasets/{_REPO}/preupload/{_REV}", "preupload"),
    ("POST", rf"/api/datasets/{_REPO}/commit/{_REV}", "commit"),
    ("POST", rf"/datasets/{_REPO}\.git/info/lfs/objects/batch", "lfs_batch"),
    ("PUT", r"/lfs-upload/(?P<repo>[^/]+)/(?P<oid>[0-9a-f]{64})", "lfs_upload"),
    ("POST", r"/lfs-verify/(?P<repo>[^/]+)/(?P<oid>[0-9a-f]{64})", "lfs_verify"),
    ("GET", rf"/datasets/{_REPO}/resolve/{_REV}/(?P<path>.+)", "resolve"),
    # a model repo (``--model hf://ORG/NAME``): its revision and its files, the same state as a dataset's
    ("GET", rf"/api/models/{_REPO}/revision/{_REV}", "revision"),
    ("GET", rf"/api/models/{_REPO}/tree/{_REV}(?:/(?P<path>.+))?", "tree"),
    ("GET", rf"/{_REPO}/resolve/{_REV}/(?P<path>.+)", "resolve"),
]


@pytest.fixture
def fake_hub() -> Iterator[FakeHub]:
    """A fresh fake Hub on a free 127.0.0.1 port (no token required)."""
    hub = FakeHub()
    hub.start()
    try:
        yield hub
    finally:
        hub.stop()


@pytest.fixture
def hub_env(fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeHub:
    """huggingface_hub aimed at the fake for one test: HF_ENDPOINT, a dummy HF_TOKEN, its own HF_HOME, no
    telemetry, and xet off (read at import into `constants`, so patched there too)."""
    import huggingface_hub.constants as hf_constants  # noqa: PLC0415 - after the env is set

    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url)
    monkeypatch.setenv("HF_TOKEN", "hf_dummy_test_token")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_TELEMETRY", True)
    return fake_hub
