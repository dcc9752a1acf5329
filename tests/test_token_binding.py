"""Approvals bound to what the person saw (issue 53, point 2): an overwrite token covers OUT's path, the change and
what OUT held when it was printed (its files' names, sizes and times: a listing, `infra.gates.conflicts.held`). A token
printed for a foreign OUT is void once a file there is added or changed: the build is refused with one line that
says so and prints the token for what OUT holds now, and nothing is replaced; that new token works.

Before: the token was `sha256(path, old fingerprint, new fingerprint)`; the same token, printed before a file was added
to the foreign OUT, replaced the folder's contents with a file the person never saw listed."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner, Result

from flows.cli import app
from infra.gates.conflicts import held, overwrite_token
from infra.publish.base import LocalFile, RemoteFile, parse_target
from infra.publish.diff import replace_token
from infra.publish.hub import _remote_file
from tests.conftest import HEIGHT, WIDTH, make_shards, sample
from tests.media_utils import cut_clip

#: Files in OUT for the digest measurement (issue 53: "measure it for 10^4 files once").
MANY = 10_000


@pytest.fixture(scope="module")
def source(clips, tmp_path_factory) -> Path:
    video = cut_clip(clips["carphone"], 9)
    return make_shards(tmp_path_factory.mktemp("token-src"), {"s": [sample(0, 0, video, b"a clip that moves")]})


def _build(source: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return [
        "build", "--source", f"vbvr:{source}", "--model", str(model), "--out", str(out), "--frames", "5",
        "--height", str(HEIGHT), "--width", str(WIDTH), "--device", "cpu", "--dtype", "fp32", "--workers", "1",
        "--decode-samples", "0", "--on-loss", "accept", *extra,
    ]  # fmt: skip


def _error(result: Result) -> str:
    lines = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.output[-3000:]
    return lines[0]


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_token_printed_for_a_foreign_out_is_void_once_its_files_change(source, tiny_model, tmp_path):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("a person's notes")
    (out / "sub" / "weights.bin").write_bytes(b"w" * 100)
    args = _build(source, tiny_model, out)
    stopped = CliRunner().invoke(app, [*args, "--on-conflict", "abort"])
    assert stopped.exit_code == 1, stopped.output[-3000:]
    printed = re.search(r"--approve-overwrite (\w+) to replace it", _error(stopped)).group(1)

    for change in ("added", "rewritten"):  # a file the person never saw listed; one changed in place, same size
        if change == "added":
            (out / "sub" / "later.pt").write_bytes(b"a file added after the token was printed")
        else:
            (out / "notes.txt").write_text("A PERSON'S NOTES")
            later = time.time_ns() + 10**9
            os.utime(out / "notes.txt", ns=(later, later))
        before = _files(out)
        refused = CliRunner().invoke(app, [*args, "--approve-overwrite", printed])
        assert refused.exit_code == 1, refused.output[-3000:]
        error = _error(refused)
        assert f"--approve-overwrite {printed} was printed for what {out} held then" in error, error
        assert "changed since" in error and "nothing was replaced" in error, error
        printed_now = re.search(r"and --approve-overwrite (\w+) approves this change of it", error).group(1)
        assert printed_now != printed
        assert _files(out) == before  # nothing replaced, no cache.json
        printed = printed_now

    replaced = CliRunner().invoke(app, [*args, "--approve-overwrite", printed])
    assert replaced.exit_code == 0, replaced.output[-3000:]
    assert (out / "cache.json").is_file() and "1 done" in replaced.output


def test_the_digest_covers_names_sizes_and_times_but_not_latentforges_own_bookkeeping(tmp_path):
    out = tmp_path / "out"
    (out / "ledger" / "plan").mkdir(parents=True)
    (out / "a.pt").write_bytes(b"a")
    first = overwrite_token(out, None, "f" * 64)
    for rel in (".latentforge.lock", "reports/run-1.json", "ledger/plan.json", "ledger/plan/s.jsonl"):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text("bookkeeping a run rewrites")
    assert overwrite_token(out, None, "f" * 64) == first
    (out / "b").symlink_to("/etc/passwd")  # a link: listed as one, never followed
    linked = overwrite_token(out, None, "f" * 64)
    assert linked != first and linked[:12] == first[:12]  # the same path and change, another content
    assert overwrite_token(out, None, "e" * 64)[:12] != first[:12]


def test_the_digest_of_ten_thousand_files_is_a_listing(tmp_path):
    """The cost a conflict pays (measured here, written to RELIABILITY.md): one stat a file, no byte read."""
    out = tmp_path / "out"
    for folder in range(MANY // 1000):
        (out / f"g{folder}").mkdir(parents=True)
        for i in range(1000):
            (out / f"g{folder}" / f"{i:05d}.pt").write_bytes(b"x")
    started = time.perf_counter()
    found = held(out)
    seconds = time.perf_counter() - started
    print(f"held() of {MANY} files: {seconds * 1000:.0f} ms")
    assert found.files == MANY and found.bytes == MANY
    assert seconds < 5.0


def test_a_replace_token_covers_the_version_of_each_remote_file_it_replaces():
    """The upload's replace token (checked: it had no hole but one): each replaced remote file's version is in it, an
    S3 ETag, a Hub sha256 or git blob id, and now a Hub xet file's hash too (before: a xet file without an LFS pointer
    had no version, so its token held only its size, and a same-size change since the token was printed passed)."""
    target = parse_target("hf://datasets/org/name")
    ours = LocalFile("shards/00000.tar", 10, "a" * 64, "data", data=b"0123456789")
    xet = [_remote_file(ours.path, SimpleNamespace(size=10, lfs=None, xet_hash=h)) for h in ("1" * 64, "2" * 64)]
    assert replace_token(target, [(ours, xet[0])]) != replace_token(target, [(ours, xet[1])])
    s3 = [RemoteFile(ours.path, 10, etag=e) for e in ('"e1"', '"e2"')]
    assert replace_token(target, [(ours, s3[0])]) != replace_token(target, [(ours, s3[1])])
