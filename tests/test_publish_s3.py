"""The S3 store against a real moto server over HTTP: metadata, listing, conditional (no-clobber) writes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.config import UploadConfig
from infra.publish.base import LocalFile, PublishError, RemoteConflict, RemoteFile, Target, parse_target, same_content
from infra.publish.s3 import S3Remote, make_s3_remote
from tests import s3_server
from tests.conftest import config, make_shards, sample
from tests.media_utils import cut_clip
from tests.s3_server import SECRET_KEY

CHUNK_MB = 5  # the smallest part size S3 allows
BIG = 11 * 1024 * 1024  # over the multipart threshold: parts of 5 + 5 + 1 MiB
PREFIX = "caches/run1"

moto_server, s3_env = s3_server.moto_server, s3_server.s3_env  # the fixtures, by name


def _config(**overrides: Any) -> UploadConfig:
    values: dict[str, Any] = {"to": f"s3://bucket/{PREFIX}", "chunk_mb": CHUNK_MB, "workers": 3, **overrides}
    return UploadConfig(**values)


@pytest.fixture
def bucket(s3_env: str) -> str:
    name = f"lf-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


@pytest.fixture
def client(s3_env: str) -> Any:
    """A plain client of the default chain: the test's own view of the bucket (and 'someone else')."""
    return boto3.client("s3")


@pytest.fixture
def remote(bucket: str) -> S3Remote:
    return make_s3_remote(parse_target(f"s3://{bucket}/{PREFIX}"), _config())


def _file(root: Path, path: str, data: bytes, role: str = "data") -> LocalFile:
    source = root / path
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_bytes(data)
    return LocalFile(path, len(data), hashlib.sha256(data).hexdigest(), role, source=source)  # type: ignore[arg-type]


def _big(seed: int) -> bytes:
    return random.Random(seed).randbytes(BIG)


def _send(remote: S3Remote, files: list[LocalFile], replace: dict[str, RemoteFile] | None = None) -> list[str]:
    sent: list[str] = []
    remote.send(files, replace=replace or {}, on_sent=lambda f: sent.append(f.path))
    return sent


def _object(client: Any, bucket: str, path: str) -> tuple[bytes, dict[str, str]]:
    response = client.get_object(Bucket=bucket, Key=f"{PREFIX}/{path}")
    return response["Body"].read(), response["Metadata"]


def _cache(root: Path) -> list[LocalFile]:
    card = b"# a dataset card\n"
    return [
        _file(root, "G-11_part-00000/sample_000.pt", b"latent zero" * 100),
        _file(root, "G-11_part-00000/sample_001.pt", _big(1)),
        _file(root, "reports/run.json", b'{"ok": true}', "report"),
        LocalFile("README.md", len(card), hashlib.sha256(card).hexdigest(), "card", data=card),
        _file(root, "cache.json", b'{"fingerprint": "abc"}', "manifest"),
    ]


def test_send_stores_bytes_with_sha256_and_list_proves_them_unchanged(tmp_path, remote, client, bucket):
    files = _cache(tmp_path)
    assert sorted(_send(remote, files)) == sorted(f.path for f in files)
    for f in files:
        data, metadata = _object(client, bucket, f.path)
        assert data == f.read_bytes()
        assert metadata == {"sha256": f.sha256, "latentforge-role": f.role}
    listed = remote.list()
    assert set(listed) == {f.path for f in files}
    for f in files:
        assert (listed[f.path].size, listed[f.path].sha256) == (f.size, f.sha256)
        assert same_content(f, listed[f.path]) is True
    assert listed["G-11_part-00000/sample_001.pt"].etag.endswith('-3"')  # a real 3-part multipart upload
    assert remote.read("cache.json") == b'{"fingerprint": "abc"}'
    assert remote.read("not-there.json") is None


def test_a_path_that_exists_is_never_overwritten_without_replace(tmp_path, remote, client, bucket):
    small = _file(tmp_path / "a", "cache.json", b"first")
    big = _file(tmp_path / "a", "shard/big.pt", _big(1))
    _send(remote, [small, big])
    for path, other in (("cache.json", b"second"), ("shard/big.pt", _big(2))):
        with pytest.raises(RemoteConflict, match=f"s3://{bucket}/{PREFIX}/{path}"):
            _send(remote, [_file(tmp_path / "b", path, other)])
    assert _object(client, bucket, "cache.json")[0] == b"first"
    assert _object(client, bucket, "shard/big.pt")[0] == _big(1)
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    etags = {path: f.etag for path, f in remote.list().items()}
    # The same bytes again (a PUT retried after a lost reply finds its own object): kept, reported as stored.
    assert sorted(_send(remote, [small, big])) == ["cache.json", "shard/big.pt"]
    assert {path: f.etag for path, f in remote.list().items()} == etags


def test_a_conflict_stops_the_send_and_reports_only_what_was_stored(tmp_path, remote, client, bucket):
    client.put_object(Bucket=bucket, Key=f"{PREFIX}/d/003.pt", Body=b"someone else")
    files = [_file(tmp_path, f"d/{i:03d}.pt", f"sample {i}".encode()) for i in range(12)]
    sent: list[str] = []
    with pytest.raises(RemoteConflict, match=r"d/003\.pt"):
        remote.send(files, replace={}, on_sent=lambda f: sent.append(f.path))
    assert "d/003.pt" not in sent
    listed = remote.list()
    assert all(same_content(f, listed[f.path]) for f in files if f.path in sent)
    assert _object(client, bucket, "d/003.pt")[0] == b"someone else"


def test_the_server_refuses_a_multipart_upload_onto_an_object_that_appeared(
    tmp_path, remote, client, bucket, monkeypatch
):
    """Skip the client-side pre-check, as if the object appeared during the upload: moto enforces
    If-None-Match on CompleteMultipartUpload, the upload is aborted and nothing changes."""
    client.put_object(Bucket=bucket, Key=f"{PREFIX}/shard/big.pt", Body=b"someone else")
    monkeypatch.setattr(S3Remote, "_precheck", lambda *_: None)
    sent: list[str] = []
    with pytest.raises(RemoteConflict, match="PreconditionFailed"):
        remote.send([_file(tmp_path, "shard/big.pt", _big(1))], replace={}, on_sent=lambda f: sent.append(f.path))
    assert sent == []
    assert _object(client, bucket, "shard/big.pt")[0] == b"someone else"
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_replace_needs_the_listed_etag(tmp_path, remote, client, bucket):
    _send(remote, [_file(tmp_path / "v1", "ledger.jsonl", b"v1"), _file(tmp_path / "v1", "big.pt", _big(1))])
    listed = remote.list()
    for path, data in (("ledger.jsonl", b"v2 by someone else"), ("big.pt", _big(2))):
        client.put_object(Bucket=bucket, Key=f"{PREFIX}/{path}", Body=data)  # the listed version is now stale
        with pytest.raises(RemoteConflict, match=path):
            _send(remote, [_file(tmp_path / "v3", path, data + b"v3")], replace={path: listed[path]})
        assert _object(client, bucket, path)[0] == data
    fresh = remote.list()
    mine = [_file(tmp_path / "v4", "ledger.jsonl", b"v4", "ledger"), _file(tmp_path / "v4", "big.pt", _big(4))]
    assert sorted(_send(remote, mine, replace=fresh)) == ["big.pt", "ledger.jsonl"]
    after = remote.list()
    for f in mine:
        assert _object(client, bucket, f.path)[0] == f.read_bytes()
        assert same_content(f, after[f.path]) is True


def test_replace_of_an_object_deleted_since_listing_is_a_conflict(tmp_path, remote, client, bucket):
    _send(remote, [_file(tmp_path, "card.md", b"old card", "card")])
    listed = remote.list()
    client.delete_object(Bucket=bucket, Key=f"{PREFIX}/card.md")
    with pytest.raises(RemoteConflict, match=r"card\.md"):
        _send(remote, [_file(tmp_path / "new", "card.md", b"new card", "card")], replace=listed)
    assert remote.list() == {}


def test_what_moto_enforces_on_complete_multipart_upload(client, bucket):
    """moto 5.2.5 enforces If-None-Match: * on CompleteMultipartUpload but ignores If-Match there (AWS
    enforces both); S3Remote's pre-check is what refuses a stale If-Match multipart replace on moto."""
    key = "k"
    client.put_object(Bucket=bucket, Key=key, Body=b"old")

    def complete(**condition: str) -> None:
        upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        etag = client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"new")["ETag"]
        parts = {"Parts": [{"PartNumber": 1, "ETag": etag}]}
        client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload=parts, **condition)

    with pytest.raises(client.exceptions.ClientError, match="PreconditionFailed"):
        complete(IfNoneMatch="*")
    complete(IfMatch='"0123456789abcdef0123456789abcdef"')  # a stale etag: moto completes anyway
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == b"new"
    with pytest.raises(client.exceptions.ClientError, match="PreconditionFailed"):  # put_object: enforced
        client.put_object(Bucket=bucket, Key=key, Body=b"x", IfMatch='"0123456789abcdef0123456789abcdef"')


def test_a_file_changed_since_hashing_is_not_sent(tmp_path, remote, client, bucket):
    small = _file(tmp_path, "a.pt", b"original")
    big = _file(tmp_path, "b.pt", _big(1))
    small.source.write_bytes(b"modified")
    big.source.write_bytes(_big(2))
    for f in (small, big):
        with pytest.raises(PublishError, match="changed since it was hashed"):
            _send(remote, [f])
    assert remote.list() == {}
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_a_failed_part_stops_the_upload_and_aborts_it(tmp_path, client, bucket, monkeypatch):
    remote = S3Remote(parse_target(f"s3://{bucket}/{PREFIX}"), _config(workers=1), client=client)
    real, calls = client.upload_part, []

    def flaky(**kwargs: Any) -> Any:
        calls.append(kwargs["PartNumber"])
        if kwargs["PartNumber"] == 2:
            raise ClientError({"Error": {"Code": "InternalError", "Message": "injected"}}, "UploadPart")
        return real(**kwargs)

    monkeypatch.setattr(client, "upload_part", flaky)
    with pytest.raises(PublishError, match="InternalError"):
        _send(remote, [_file(tmp_path, "big.pt", _big(1) * 2)])  # 22 MiB: five parts
    assert calls == [1, 2], "parts after the failed one were still sent"
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert remote.list() == {}


def test_no_credentials_is_a_clear_error(bucket, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(PublishError, match="no AWS credentials found"):
        make_s3_remote(parse_target(f"s3://{bucket}/{PREFIX}"), _config()).list()


def test_aws_endpoint_url_routes_the_client(s3_env, bucket, monkeypatch):
    target = parse_target(f"s3://{bucket}/{PREFIX}")
    assert make_s3_remote(target, _config())._client.meta.endpoint_url == s3_env
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    elsewhere = make_s3_remote(target, _config())
    assert elsewhere._client.meta.endpoint_url == "http://127.0.0.1:9"
    with pytest.raises(PublishError, match=r"127\.0\.0\.1:9"):
        elsewhere.list()


def test_list_of_an_empty_prefix_is_empty_and_a_missing_bucket_is_an_error(tmp_path, client, bucket, remote):
    client.put_object(Bucket=bucket, Key=f"{PREFIX}x/neighbour.pt", Body=b"not ours")  # shares the text prefix
    client.put_object(Bucket=bucket, Key="elsewhere/file.pt", Body=b"not ours")
    assert remote.list() == {}
    with pytest.raises(PublishError, match="NoSuchBucket"):
        make_s3_remote(parse_target("s3://no-such-bucket-here/x"), _config()).list()


def test_objects_written_by_others_have_no_sha256(tmp_path, remote, client, bucket):
    client.put_object(Bucket=bucket, Key=f"{PREFIX}/foreign.bin", Body=b"12345")
    client.put_object(Bucket=bucket, Key=f"{PREFIX}/bad.bin", Body=b"12345", Metadata={"sha256": "not-hex"})
    listed = remote.list()
    assert listed["foreign.bin"] == RemoteFile("foreign.bin", 5, etag=listed["foreign.bin"].etag)
    assert listed["bad.bin"].sha256 is None
    assert same_content(_file(tmp_path, "foreign.bin", b"12345"), listed["foreign.bin"]) is None


def test_secrets_never_reach_the_log(tmp_path, remote, caplog):
    with caplog.at_level(logging.DEBUG):
        _send(remote, [_file(tmp_path, "a.pt", b"data")])
        remote.list()
    assert caplog.records and SECRET_KEY not in caplog.text


def test_a_credentials_block_needs_prefect_aws_and_is_used_when_there(s3_env, bucket, monkeypatch):
    target = parse_target(f"s3://{bucket}/{PREFIX}")
    monkeypatch.setitem(sys.modules, "prefect_aws", None)
    with pytest.raises(PublishError, match="pip install prefect-aws"):
        make_s3_remote(target, _config(aws_credentials_block="team-s3"))

    loaded: list[str] = []

    class AwsCredentials:  # the part of prefect_aws.AwsCredentials S3Remote uses
        aws_client_parameters = types.SimpleNamespace(get_params_override=lambda: {})

        @classmethod
        def load(cls, name: str) -> AwsCredentials:
            loaded.append(name)
            return cls()

        def get_boto3_session(self) -> boto3.Session:
            return boto3.Session(aws_access_key_id="block-key", aws_secret_access_key="block-secret")

    monkeypatch.setitem(sys.modules, "prefect_aws", types.SimpleNamespace(AwsCredentials=AwsCredentials))
    remote = make_s3_remote(target, _config(aws_credentials_block="team-s3"))
    assert loaded == ["team-s3"]
    assert remote._client._request_signer._credentials.access_key == "block-key"
    assert remote.list() == {}


def test_make_s3_remote_names_the_extra_when_boto3_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)
    with pytest.raises(PublishError, match=r"pip install latentforge\[s3\]"):
        make_s3_remote(Target("s3://b/p", "s3", bucket="b", prefix="p"), _config())


# --- end to end: `latentforge upload` on a real small cache ----------------------------------------------

LATENTFORGE = Path(sys.executable).parent / "latentforge"
DATA_FILES = 3  # samples in the small cache
COUNTS = re.compile(r"sent (\d+) new, updated (\d+), replaced 0, unchanged (\d+)")


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, clips: dict[str, bytes]) -> Path:
    """A finished cache (three samples in one shard, gates passed), built once for this module."""
    root = tmp_path_factory.mktemp("s3-cache")
    video = cut_clip(clips["carphone"], 9, width=96)
    samples = [sample(0, i, video, f"a man talks in a car, take {i}".encode()) for i in range(DATA_FILES)]
    src = make_shards(root / "src", {"G-11_part-00000": samples})
    ok, result = run_build(config(src, tiny_model, root / "out", workers=1))
    assert ok and result["done"] == DATA_FILES, result
    return root / "out"


def _copy_cache(small_cache: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(small_cache, out)
    return out


def _upload_cli(out: Path, url: str, *flags: str) -> Any:
    return CliRunner().invoke(app, ["upload", str(out), "--to", url, "--chunk-mb", str(CHUNK_MB), *flags])


def _counts(output: str) -> tuple[int, int, int]:
    found = COUNTS.search(output)
    assert found, output
    sent, updated, unchanged = map(int, found.groups())
    return sent, updated, unchanged


def _objects(client: Any, bucket: str) -> dict[str, dict[str, Any]]:
    """key → head_object of every object in the bucket."""
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    return {key: client.head_object(Bucket=bucket, Key=key) for key in keys}


def _versions(objects: dict[str, dict[str, Any]]) -> dict[str, tuple[str, Any]]:
    return {key: (head["ETag"], head["LastModified"]) for key, head in objects.items()}


def test_cli_upload_rerun_skips_unchanged_and_verify_only_finds_damage(tmp_path, small_cache, bucket, client):
    out = _copy_cache(small_cache, tmp_path)
    url = f"s3://{bucket}/{PREFIX}"
    first = _upload_cli(out, url)
    assert first.exit_code == 0, first.output
    objects = _objects(client, bucket)
    total = len(objects)
    assert _counts(first.output) == (total, 0, 0)
    assert f"remote verified: {total} of {total} files" in first.output
    for key, head in objects.items():
        local = out / key.removeprefix(f"{PREFIX}/")
        if local.is_file():  # all but the generated card
            assert head["Metadata"]["sha256"] == hashlib.sha256(local.read_bytes()).hexdigest(), key
    data = sorted(k for k, head in objects.items() if head["Metadata"]["latentforge-role"] == "data")
    assert len(data) == DATA_FILES and {h["Metadata"]["latentforge-role"] for h in objects.values()} >= {
        "manifest",
        "ledger",
    }

    second = _upload_cli(out, url)
    assert second.exit_code == 0, second.output
    assert _counts(second.output) == (0, 0, total)
    assert _versions(_objects(client, bucket)) == _versions(objects), "the rerun re-sent unchanged files"

    client.delete_object(Bucket=bucket, Key=data[0])
    same_size = b"\0" * objects[data[1]]["ContentLength"]  # someone else's bytes, no sha256 to compare
    client.put_object(Bucket=bucket, Key=data[1], Body=same_size)
    other = b"other latents"  # another writer's bytes, with their true sha256
    client.put_object(Bucket=bucket, Key=data[2], Body=other, Metadata={"sha256": hashlib.sha256(other).hexdigest()})
    damaged = _versions(_objects(client, bucket))
    check = _upload_cli(out, url, "--verify-only")
    assert check.exit_code == 1, check.output
    assert f"{total - 3} of {total} files" in check.output
    for key in data:
        assert key.removeprefix(f"{PREFIX}/") in check.output
    assert _versions(_objects(client, bucket)) == damaged, "--verify-only changed the remote"


def test_the_s3_card_names_the_bucket_and_its_snippet_loads_a_sample_from_it(tmp_path, small_cache, bucket, client):
    out = _copy_cache(small_cache, tmp_path)
    url = f"s3://{bucket}/{PREFIX}"
    assert _upload_cli(out, url).exit_code == 0
    card = client.get_object(Bucket=bucket, Key=f"{PREFIX}/README.md")["Body"].read().decode()
    assert f"\n# {url}\n" in card and f"```text\n{url}\n" in card  # the title and the layout's root
    assert "hf://" not in card and "hf_hub_download" not in card
    assert "sha256 over every byte of every file of each component" in card and "weight headers" not in card
    code = re.search(r"```python\n(.*?)```", card, re.DOTALL)
    assert code, card
    namespace: dict[str, Any] = {}
    exec(code[1], namespace)  # as a reader pastes it, against the loopback store (AWS_ENDPOINT_URL set)
    sample_ = namespace["sample"]
    assert namespace["x0"].shape == tuple(sample_["latent_shape"])
    assert int(namespace["mask"].sum()) == sample_["seq_len"]
    assert sample_["fingerprint"] == json.loads((out / "cache.json").read_text())["fingerprint"]


def _kill_once_some_objects_exist(
    cmd: list[str], env: dict[str, str], client: Any, bucket: str, log: Path, *, more_than: int
) -> str:
    """Run the CLI in its own process group and SIGKILL it once the bucket holds more than `more_than`
    objects; its output."""
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while proc.poll() is None and time.monotonic() < deadline:
                if client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) > more_than:
                    break
                time.sleep(0.02)
        finally:
            with contextlib.suppress(ProcessLookupError):  # it finished before the kill
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    output = log.read_text(errors="replace")
    assert proc.returncode == -signal.SIGKILL, f"the upload ended on its own ({proc.returncode}):\n{output[-3000:]}"
    return output


def test_a_killed_upload_resumes_sending_only_what_is_missing(tmp_path, small_cache, bucket, client):
    from prefect.settings import PREFECT_API_URL  # noqa: PLC0415 - the session harness's API

    out = _copy_cache(small_cache, tmp_path)
    for i in range(6):  # reports (named as latentforge names them) are published: bulk for a workers=1 upload
        (out / "reports" / f"bulk-20000101T00000{i}Z.bin").write_bytes(random.Random(i).randbytes(7 * 1024 * 1024))
    url = f"s3://{bucket}/{PREFIX}"
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "PREFECT_HOME": str(tmp_path / "home")}
    cmd = [str(LATENTFORGE), "upload", str(out), "--to", url, "--workers", "1", "--chunk-mb", str(CHUNK_MB)]
    _kill_once_some_objects_exist(cmd, env, client, bucket, tmp_path / "killed.log", more_than=DATA_FILES)
    before = _versions(_objects(client, bucket))
    assert len(before) > DATA_FILES, "the kill came before the report stage"

    rerun = _upload_cli(out, url, "--workers", "1")
    assert rerun.exit_code == 0, rerun.output
    after = _versions(_objects(client, bucket))
    sent, updated, unchanged = _counts(rerun.output)
    assert (sent, updated, unchanged) == (len(after) - len(before), 0, len(before)), rerun.output
    assert sent > 0, "the kill came after the last object"
    assert {key: after[key] for key in before} == before, "the rerun re-sent files the killed upload had stored"
    assert f"remote verified: {len(after)} of {len(after)} files" in rerun.output
