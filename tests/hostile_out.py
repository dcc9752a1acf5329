"""Hostile OUT trees for tests/test_containment.py: a copy of a real cache beside a watched folder (`victim`) that no
command may change, holding a secret that must never reach a remote; and the attacker's moves (links, ledger rows
that point out of OUT). The moves write the files directly, as an attacker would, never through latentforge."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infra.cache import ledger
from infra.cache.ledger import LedgerRow

SECRET = b"latentforge containment secret: never read into a cache, never uploaded\n"


@dataclass(frozen=True)
class Scene:
    """OUT (a copy of a built cache), the watched sibling folder, and the secret in it."""

    out: Path
    victim: Path

    @property
    def secret(self) -> Path:
        return self.victim / "secret.txt"

    def snapshot(self) -> dict[str, str]:
        """Every entry under the watched folder: a file's sha256, a folder, a link's target."""
        found = {}
        for path in sorted(self.victim.rglob("*")):
            rel = path.relative_to(self.victim).as_posix()
            found[rel] = f"-> {path.readlink()}" if path.is_symlink() else "dir" if path.is_dir() else _sha(path)
        return found


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def scene(built: Path, root: Path) -> Scene:
    """`built` copied to ``root/out`` and a watched ``root/victim`` holding the secret."""
    out = Path(shutil.copytree(built, root / "out", symlinks=True))
    (root / "victim").mkdir()
    (root / "victim" / "secret.txt").write_bytes(SECRET)
    return Scene(out, root / "victim")


def done_rows(out: Path) -> list[LedgerRow]:
    """The done rows of every shard, in ledger order."""
    return [row for rows in ledger.read_all(out).values() for row in rows.values() if row.status == "done"]


def rewrite_rows(out: Path, shard: str, change: dict[str, dict[str, Any]]) -> None:
    """Rewrite sealed ledger rows by key (`change`: key → fields; a value None removes the row)."""
    sealed = ledger.sealed_path(out, shard)
    rows = [json.loads(line) for line in sealed.read_text().splitlines() if line.strip()]
    kept = []
    for row in rows:
        fields = change.get(row["key"], {})
        if fields is not None:
            kept.append({**row, **fields})
    sealed.write_text("".join(json.dumps(row) + "\n" for row in kept))


def point_row_at(scene: Scene, row: LedgerRow, path: str, payload: Path) -> None:
    """Make `row`'s file record name `path` (outside OUT), with `payload`'s size and sha256 so that a follower would
    find it whole."""
    size, digest = payload.stat().st_size, _sha(payload)
    fields = {"path": path, "bytes": size, "sha256": digest, "files": []}
    rewrite_rows(scene.out, row.shard, {row.key: fields})


def swap_for_link(path: Path, target: Path) -> None:
    """Move the folder or file at `path` to `target` (in the watched folder) and leave a link to it in its place: a
    follower sees the same tree, reached through a link."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        shutil.move(str(path), str(target))
    elif not target.exists():
        target.mkdir()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target, target_is_directory=target.is_dir())


def bodies(client: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    """key → bytes of every object under `prefix`."""
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}


#: Where a link out of OUT is planted: each folder or file moved into the watched folder, a link left in its place.
LINKED = ("group", "sample", "reports", "decode", "ledger", "nested-report", "kept-spec")
#: Ledger paths that leave OUT ({victim}: the watched folder, absolute; {group}: a group folder of OUT).
ROW_PATHS = ("../victim/{name}", "{victim}/{name}", "{group}/../../victim/{name}")
#: In the payloads planted in the watched folder: never to be found in an export or on the remote.
PAYLOAD = "VICTIM PAYLOAD, outside OUT"


@dataclass(frozen=True)
class Hostile:
    """One hostile OUT tree: links planted, ledger rows pointed out of OUT, a group a resume encodes into a link."""

    links: tuple[str, ...]
    rows: tuple[str, ...]
    depth: int  # folders above the nested report's link
    new_group: bool


def _payload(where: Scene, row: LedgerRow, name: str) -> Path:
    """A whole sample of this cache in the watched folder, told apart by its prompt."""
    record = torch.load(where.out / str(row.path), weights_only=True)
    torch.save({**record, "prompt": PAYLOAD}, where.victim / name)
    return where.victim / name


def _nested(where: Scene, depth: int) -> None:
    folder = where.out.joinpath("reports", *(f"d{i}" for i in range(depth)))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.md").symlink_to(where.secret)


_LINKS: dict[str, Callable[[Scene, LedgerRow, int], None]] = {
    "group": lambda w, row, _: swap_for_link(w.out / row.group, w.victim / "group"),
    "sample": lambda w, row, _: swap_for_link(w.out / str(row.path), w.victim / "sample.pt"),
    "reports": lambda w, _, __: swap_for_link(w.out / "reports", w.victim / "reports"),
    "decode": lambda w, _, __: swap_for_link(w.out / "reports" / "decode", w.victim / "decode"),
    "ledger": lambda w, _, __: swap_for_link(w.out / "ledger", w.victim / "ledger"),
    "nested-report": lambda w, _, depth: _nested(w, depth),
    "kept-spec": lambda w, _, __: (w.out / "cache.0123456789abcdef.json").symlink_to(w.secret),
}


def plant(where: Scene, hostile: Hostile) -> None:
    """Make OUT the hostile tree `hostile` describes (rows first: the links may move the ledger away)."""
    rows = done_rows(where.out)
    for i, pattern in enumerate(hostile.rows):
        row, name = rows[1 + i], f"row{i}.pt"  # rows[0] keeps its own file: the links use it
        payload = _payload(where, row, name)
        point_row_at(where, row, pattern.format(victim=where.victim, name=name, group=row.group), payload)
    if hostile.new_group:  # its rows gone, its files moved out, a link in its place: a resume encodes into it
        group = rows[-1].group
        rewrite_rows(where.out, rows[-1].shard, {r.key: None for r in rows if r.group == group})
        swap_for_link(where.out / group, where.victim / "new-group")
    for place in hostile.links:
        _LINKS[place](where, rows[0], hostile.depth)
