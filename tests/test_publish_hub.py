"""The Hub store against a loopback fake Hub that the real huggingface_hub client talks to (LFS transport; xet is
verified only against the real Hub): round trip, batched commits as resume points, conflicts, token hygiene."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import Result
from huggingface_hub import HfApi
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.config import UploadConfig
from infra.publish.base import (
    LocalFile,
    PublishError,
    RemoteConflict,
    RemoteFile,
    Role,
    parse_target,
    same_content,
)
from infra.publish.card import card_file
from infra.publish.hub import MAX_ENTRIES_PER_FOLDER, MAX_FILES_PER_REPO, HubRemote, layout_warnings
from tests import fakehub
from tests.conftest import config, make_shards, sample
from tests.fakehub import FakeHub
from tests.media_utils import cut_clip

REPO = "latentforge-test/tiny-cache"
BINARY_BYTES = 96 * 1024  # binary: LFS on the Hub whatever its size
SECRET = "hf_blockTokenNeverLogged0123456789"

fake_hub, hub_env = fakehub.fake_hub, fakehub.hub_env  # the fixtures, by name


def _file(root: Path, path: str, data: bytes, role: Role = "data") -> LocalFile:
    source = root / path
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_bytes(data)
    return LocalFile(path, len(data), hashlib.sha256(data).hexdigest(), role, source=source)


def _cache_files(root: Path, samples: int = 3) -> list[LocalFile]:
    """In send order: binary samples (LFS), a generated card and a small JSON (regular)."""
    data = [_file(root, f"group-a/sample_{i:04d}.pt", b"\0PK" + os.urandom(BINARY_BYTES)) for i in range(samples)]
    card = b"---\nlicense: other\n---\n\n# a card\n"
    card_file = LocalFile("README.md", len(card), hashlib.sha256(card).hexdigest(), "card", data=card)
    return [*data, card_file, _file(root, "cache.json", b'{"fingerprint": "abc"}\n', "manifest")]


def _remote(url: str = f"hf://datasets/{REPO}", **options: object) -> HubRemote:
    return HubRemote(parse_target(url), UploadConfig(to=url, **{"commit_every": 2, **options}))


def _missing(files: list[LocalFile], listed: dict[str, RemoteFile]) -> list[LocalFile]:
    """What the core sends on a rerun: every file the remote does not prove identical."""
    return [f for f in files if f.path not in listed or not same_content(f, listed[f.path])]


def test_send_lists_back_with_hashes_in_one_commit_per_batch(hub_env: FakeHub, tmp_path: Path) -> None:
    files = _cache_files(tmp_path)
    remote = _remote()
    assert remote.list() == {} and hub_env.created == []  # listing never creates the repo
    sent: list[str] = []
    remote.send(files, replace={}, on_sent=lambda f: sent.append(f.path))
    assert sent == [f.path for f in files]
    assert hub_env.commits_made(REPO) == 3  # 5 files, commit_every=2
    assert hub_env.created[0]["visibility"] == "private"
    hub_env.page_size = 2  # the listing follows Link paging
    listed = _remote().list()
    assert set(listed) == {f.path for f in files}  # the Hub's own .gitattributes is not a cache file
    for file in files:
        assert same_content(file, listed[file.path]) is True
    assert listed["group-a/sample_0000.pt"].sha256 == files[0].sha256  # LFS: content sha256
    assert listed["cache.json"].git_sha1 is not None and listed["cache.json"].sha256 is None  # regular: git sha1
    assert _remote().read("cache.json") == files[-1].read_bytes()
    (info,) = HfApi(endpoint=hub_env.url).get_paths_info(REPO, ["group-a/sample_0001.pt"], repo_type="dataset")
    assert info.lfs is not None and info.lfs.sha256 == files[1].sha256  # the fake's paths-info agrees
    assert _remote().read("nope.json") is None
    assert _remote("hf://datasets/latentforge-test/absent").read("cache.json") is None


@pytest.mark.parametrize("fault", ["fail", "drop", "lose"])
def test_a_failed_commit_keeps_the_landed_ones_and_the_rerun_sends_only_what_is_missing(
    hub_env: FakeHub, tmp_path: Path, fault: str
) -> None:
    files = _cache_files(tmp_path, samples=5)  # commits: [s0 s1] [s2 s3] [s4 card] [cache.json]
    inject = {"fail": hub_env.fail_commit, "drop": hub_env.drop_commit, "lose": hub_env.lose_commit_response}
    inject[fault](2)  # fail: a 4xx; drop: connection closed unanswered; lose: applied, then the answer lost
    sent: list[str] = []
    with pytest.raises(PublishError) as raised:
        _remote().send(files, replace={}, on_sent=lambda f: sent.append(f.path))
    assert not isinstance(raised.value, RemoteConflict)
    assert sent == [f.path for f in files[:2]]  # on_sent only once a commit landed
    landed = set(hub_env.files(REPO)) - {".gitattributes"}
    assert landed == {f.path for f in files[: 4 if fault == "lose" else 2]}
    stored = set(hub_env.repos[REPO].lfs)  # s2 and s3 reached the LFS store before their commit failed
    hub_env.clear_log()

    rerun = _remote()
    missing = _missing(files, rerun.list())
    assert [f.path for f in missing] == [f.path for f in files if f.path not in landed]
    rerun.send(missing, replace={}, on_sent=lambda f: None)
    assert set(hub_env.files(REPO)) - {".gitattributes"} == {f.path for f in files}
    never_stored = [f for f in missing if f.role == "data" and f.sha256 not in stored]
    assert [f.path for f in never_stored] == ["group-a/sample_0004.pt"]
    assert hub_env.put_bytes() == never_stored[0].size  # no byte already on the Hub is sent again
    assert hub_env.count("POST", "/commit/") == -(-len(missing) // 2)


def test_an_unchanged_rerun_sends_nothing(hub_env: FakeHub, tmp_path: Path) -> None:
    files = _cache_files(tmp_path)
    _remote().send(files, replace={}, on_sent=lambda f: None)
    hub_env.clear_log()
    assert _missing(files, _remote().list()) == []
    assert hub_env.put_bytes() == 0 and hub_env.count("POST", "/commit/") == 0


def test_a_concurrent_commit_after_the_listing_is_a_conflict_not_a_clobber(hub_env: FakeHub, tmp_path: Path) -> None:
    files = _cache_files(tmp_path)
    _remote().send(files[:1], replace={}, on_sent=lambda f: None)
    remote = _remote()
    remote.list()
    hub_env.commit(REPO, {"notes.txt": b"someone else was here\n"})
    with pytest.raises(RemoteConflict, match="branch moved"):
        remote.send(files[1:], replace={}, on_sent=lambda f: None)
    assert set(hub_env.files(REPO)) == {".gitattributes", files[0].path, "notes.txt"}


def test_a_commit_between_two_batches_stops_the_upload(hub_env: FakeHub, tmp_path: Path) -> None:
    files = _cache_files(tmp_path)
    remote = _remote()

    def someone_else_commits(file: LocalFile) -> None:
        if file is files[1]:  # the first batch landed: another writer moves the branch
            hub_env.commit(REPO, {files[2].path: b"\0their version"})

    with pytest.raises(RemoteConflict):
        remote.send(files, replace={}, on_sent=someone_else_commits)
    assert hub_env.files(REPO)[files[2].path] == b"\0their version"  # theirs stays


def test_replace_only_the_version_that_was_listed(hub_env: FakeHub, tmp_path: Path) -> None:
    old = _file(tmp_path / "old", "ledger/shard-0.jsonl", b'{"status": "done"}\n', "ledger")
    _remote().send([old], replace={}, on_sent=lambda f: None)
    new = _file(tmp_path, "ledger/shard-0.jsonl", b'{"status": "done"}\n{"status": "skipped"}\n', "ledger")
    remote = _remote()
    listed = remote.list()
    with pytest.raises(RemoteConflict, match="not approved"):
        remote.send([new], replace={}, on_sent=lambda f: None)
    stale = RemoteFile(new.path, old.size, git_sha1="0" * 40)
    with pytest.raises(RemoteConflict, match="changed on the remote"):
        remote.send([new], replace={new.path: stale}, on_sent=lambda f: None)
    remote.send([new], replace={new.path: listed[new.path]}, on_sent=lambda f: None)
    assert hub_env.files(REPO)[new.path] == new.read_bytes()


def test_a_prefix_on_a_new_branch(hub_env: FakeHub, tmp_path: Path) -> None:
    url = f"hf://datasets/{REPO}@cache-v2/latents/wan22"
    files = _cache_files(tmp_path)
    remote = _remote(url, commit_every=10, private=False)
    assert remote.list() == {}
    remote.send(files, replace={}, on_sent=lambda f: None)
    assert set(hub_env.files(REPO, "cache-v2")) == {".gitattributes"} | {f"latents/wan22/{f.path}" for f in files}
    assert set(hub_env.files(REPO, "main")) == {".gitattributes"}
    assert set(_remote(url).list()) == {f.path for f in files}
    assert hub_env.created[0]["visibility"] == "public"


def test_the_token_from_a_secret_block_is_used_and_never_shown(
    hub_env: FakeHub, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from prefect.blocks.system import Secret  # noqa: PLC0415 - needs the session's Prefect harness

    Secret(value=SECRET).save("hub-test-token", overwrite=True)
    hub_env.token = SECRET  # HF_TOKEN holds a dummy the fake refuses: only the block's token gets through
    files = _cache_files(tmp_path)
    caplog.set_level(logging.DEBUG)
    remote = _remote(hub_token_block="hub-test-token")
    remote.send(files[:2], replace={}, on_sent=lambda f: None)
    hub_env.fail_commit(1)
    with pytest.raises(PublishError) as raised:
        remote.send(files[2:], replace={}, on_sent=lambda f: None)
    assert all(r.authorized for r in hub_env.requests if not r.path.startswith("/lfs-"))
    with pytest.raises(PublishError, match="401"):
        _remote().list()  # the dummy HF_TOKEN is refused: the block's token is what got the upload through
    shown = [caplog.text, str(raised.value), repr(raised.value.__cause__), repr(remote)]
    assert not any(SECRET in text for text in shown)
    assert hub_env.commits_made(REPO) == 1


def test_layout_warnings_follow_the_hub_guidance() -> None:
    def files(paths: list[str], size: int = 1) -> list[LocalFile]:
        return [LocalFile(p, size, "0" * 64, "data", data=b"") for p in paths]

    assert layout_warnings(files([f"g/{i}.pt" for i in range(MAX_ENTRIES_PER_FOLDER)])) == []
    crowded = layout_warnings(files([f"g/{i}.pt" for i in range(MAX_ENTRIES_PER_FOLDER + 1)]))
    assert len(crowded) == 1 and "g/ holds 10,001 entries" in crowded[0] and "webdataset or parquet" in crowded[0]
    spread = [f"g{i // 5000}/{i}.pt" for i in range(MAX_FILES_PER_REPO + 1)]
    too_many = layout_warnings(files(spread))
    assert len(too_many) == 1 and "100,001 files" in too_many[0] and "shard formats" in too_many[0]
    assert "over the recommended 20 GB" in layout_warnings(files(["big.tar"], 21 * 10**9))[0]
    assert "hard limit" in layout_warnings(files(["huge.tar"], 51 * 10**9))[0]


# -- end to end: `latentforge upload` of a real cache against the fake ------------------------------------------


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, clips: dict[str, bytes]) -> Path:
    """A real cache: two shards, three samples each."""
    root = tmp_path_factory.mktemp("hub-e2e")
    clip = cut_clip(clips["carphone"], 12)
    shards = {
        f"{g}-part-00000": [sample(g, i, clip, f"clip {i} of group {g}".encode()) for i in range(3)] for g in (0, 1)
    }
    ok, result = run_build(config(make_shards(root / "src", shards), tiny_model, root / "out"))
    assert ok, result
    return root / "out"


@pytest.fixture
def out(built_cache: Path, tmp_path: Path) -> Path:
    """A copy of the cache per test (an upload writes its report into OUT)."""
    return Path(shutil.copytree(built_cache, tmp_path / "out"))


def _upload(out: Path, *extra: str) -> Result:
    return CliRunner().invoke(app, ["upload", str(out), "--to", f"hf://datasets/{REPO}", *extra])


def test_cli_upload_creates_the_dataset_with_its_card_and_the_manifest_last(hub_env: FakeHub, out: Path) -> None:
    result = _upload(out, "--commit-every", "4", "--license", "cc-by-4.0")
    assert result.exit_code == 0, result.output
    files = hub_env.files(REPO)
    expected = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    # not sent: upload reports, the private state, the recorded plan (it names the source's local paths)
    expected = {p for p in expected if not p.startswith(("reports/upload-", ".latentforge", "ledger/plan"))}
    assert set(files) - {".gitattributes"} == expected | {"README.md"}
    card = card_file(out, target=parse_target(f"hf://datasets/{REPO}"), license="cc-by-4.0")
    assert files["README.md"] == card.data and b"license: cc-by-4.0" in files["README.md"]
    repo = hub_env.repos[REPO]
    history = list(repo.commits.values())
    assert "cache.json" in history[-1] and "cache.json" not in history[-2]  # the manifest lands last
    assert hub_env.blobs(REPO)["cache.json"].lfs is False and all(
        hub_env.blobs(REPO)[p].lfs for p in expected if p.endswith(".pt")
    )
    assert "remote verified: " in result.output
    code = re.search(r"```python\n(.*?)```", files["README.md"].decode(), re.DOTALL)
    assert code and f"```text\nhf://datasets/{REPO}\n" in files["README.md"].decode()
    check = 'print(list(x0.shape) == sample["latent_shape"], int(mask.sum()) == sample["seq_len"])'
    # the card's snippet as a reader pastes it, in a fresh python (huggingface_hub reads HF_ENDPOINT at import):
    # a real hf_hub_download from the fake Hub
    ran = subprocess.run([sys.executable, "-c", code[1] + check], capture_output=True, text=True, timeout=120)
    assert ran.stdout.split() == ["True", "True"], ran.stderr[-2000:]

    hub_env.clear_log()
    again = _upload(out, "--commit-every", "4", "--license", "cc-by-4.0")
    assert again.exit_code == 0, again.output
    assert hub_env.put_bytes() == 0 and hub_env.count("POST", "/commit/") == 0  # unchanged: nothing sent
    assert hub_env.count("GET", "/tree/") == 1  # listed once: the check reuses the listing when nothing was sent
    assert "sent 0 new, updated 0" in again.output


def test_cli_upload_after_a_failed_one_sends_only_what_is_missing(hub_env: FakeHub, out: Path) -> None:
    hub_env.fail_commit(2)  # data commits of 2 files: the second fails after its LFS objects were stored
    failed = _upload(out, "--commit-every", "2")
    assert failed.exit_code == 1
    landed = set(hub_env.files(REPO)) - {".gitattributes"}
    assert len(landed) == 2 and all(p.endswith(".pt") for p in landed)
    stored = set(hub_env.repos[REPO].lfs)
    hub_env.clear_log()

    rerun = _upload(out, "--commit-every", "2")
    assert rerun.exit_code == 0, rerun.output
    samples = [p for p in out.rglob("*.pt")]
    never_stored = [p for p in samples if hashlib.sha256(p.read_bytes()).hexdigest() not in stored]
    assert len(never_stored) == 2  # the third data commit never started
    assert hub_env.put_bytes() == sum(p.stat().st_size for p in never_stored)
    assert set(hub_env.files(REPO)) >= {p.relative_to(out).as_posix() for p in samples}


def test_cli_verify_only_finds_a_file_deleted_on_the_hub(hub_env: FakeHub, out: Path) -> None:
    assert _upload(out).exit_code == 0
    intact = _upload(out, "--verify-only")
    assert intact.exit_code == 0, intact.output
    gone = sorted(p for p in hub_env.files(REPO) if p.endswith(".pt"))[0]
    hub_env.delete(REPO, gone)
    hub_env.clear_log()
    broken = _upload(out, "--verify-only")
    assert broken.exit_code == 1 and gone in broken.output
    assert hub_env.put_bytes() == 0 and hub_env.count("POST", "/commit/") == 0  # verify-only sends nothing


@pytest.mark.soak  # ~16 s; the killed-upload resume runs in make test for S3 (tests/test_publish_s3.py)
def test_cli_rerun_after_a_killed_upload_sends_nothing_already_there(
    hub_env: FakeHub, out: Path, tmp_path: Path
) -> None:
    from prefect.settings import PREFECT_API_URL  # noqa: PLC0415 - the session harness's API

    hub_env.commit_delay = 0.4  # one file per commit, each taking 0.4 s: the kill lands between commits
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "PREFECT_HOME": str(tmp_path / "home")}
    cmd = [str(Path(sys.executable).with_name("latentforge")), "upload", str(out), "--to", f"hf://datasets/{REPO}"]
    proc = subprocess.Popen(
        [*cmd, "--commit-every", "1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if REPO in hub_env.repos and hub_env.commits_made(REPO) >= 3:
                break
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the upload ended before it was killed"
    hub_env.commit_delay = 0.0
    landed = {p: hub_env.blobs(REPO)[p].sha256 for p in hub_env.files(REPO) if p != ".gitattributes"}
    assert 2 <= len(landed) < len(list(out.rglob("*.pt"))) and "cache.json" not in landed
    stored = set(hub_env.repos[REPO].lfs)
    hub_env.clear_log()

    rerun = _upload(out, "--commit-every", "1")
    assert rerun.exit_code == 0, rerun.output
    files = hub_env.files(REPO)
    assert all(hub_env.blobs(REPO)[p].sha256 == sha for p, sha in landed.items())  # nothing there was re-sent
    sent = [p for p in out.rglob("*") if p.is_file() and hashlib.sha256(p.read_bytes()).hexdigest() not in stored]
    assert hub_env.put_bytes() <= sum(p.stat().st_size for p in sent)
    assert hub_env.count("POST", "/commit/") == len(files) - len(landed) - 1  # one per missing file (+ .gitattributes)
    assert "cache.json" in files and "remote verified" in rerun.output


def test_a_file_changed_since_its_ledger_row_is_not_committed(hub_env: FakeHub, tmp_path: Path) -> None:
    files = _cache_files(tmp_path, samples=2)
    rotten = files[1]
    rotten.source.write_bytes(b"\0PK" + os.urandom(BINARY_BYTES))  # same size, other bytes than were recorded
    remote = _remote()
    remote.list()
    with pytest.raises(PublishError, match="changed on disk since they were recorded") as info:
        remote.send(files, replace={}, on_sent=lambda f: None)
    assert rotten.path in str(info.value)
    assert rotten.path not in hub_env.files(REPO)  # its batch was refused before the commit
    assert hub_env.put_bytes() == 0  # checked before the batch was sent, so not even its good file went out
