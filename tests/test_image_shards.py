"""The image family in the shard formats: real scikit-image stills from a `wds:` tar, encoded by the tiny
AutoencoderKL (+ CLIP, or no text encoder), written as webdataset and parquet parts, read back by latentforge's
training reader and by the libraries trainers use; decode-and-verify and reconcile over the parts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import webdataset
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.config import BuildConfig
from infra.formats.stream import stream_samples
from infra.plan import make_plan
from tests.conftest import config
from tests.image_media import sample_images, write_wds
from tests.steps import reconciled

runner = CliRunner()
HEIGHT, WIDTH = 32, 48
LATENT = [4, HEIGHT // 4, WIDTH // 4]  # the tiny VAE: 4 channels, 4x down, no frame axis


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    images = sample_images()
    tar = write_wds(tmp_path_factory.mktemp("image-shards") / "000.tar", images)
    return f"wds:{tar}", len(images)


def _model(root: Path, text: str) -> Path:
    out = root / f"kl-{text}"
    result = runner.invoke(app, ["make-tiny-model", str(out), "--family", "image", "--vae", "kl", "--text", text])
    assert result.exit_code == 0, result.output
    return out


def _config(source: str, model: Path, out: Path, fmt: str) -> BuildConfig:
    values = {"source": source, "family": None, "height": HEIGHT, "width": WIDTH, "frames": 1}
    return config(Path("-"), model, out, format=fmt, shard_samples=4, decode_samples=2, **values)


def _build(cfg: BuildConfig) -> dict:
    ok, result = run_build(cfg)
    assert ok, result
    return result


@pytest.mark.parametrize("fmt", ["webdataset", "parquet"])
def test_image_latents_round_trip_through_the_shard_formats(tmp_path, source, fmt):
    spec, count = source
    out = tmp_path / "out"
    cfg = _config(spec, _model(tmp_path, "clip"), out, fmt)
    result = _build(cfg)
    assert result["done"] == count and result["failed"] == 0
    records = list(stream_samples(out))
    assert len(records) == count and len({r["fingerprint"] for r in records}) == 1
    for record in records:
        assert list(record["latents"].shape) == LATENT and record["prompt"]
        assert record["text_embeddings"].shape[-1] > 0
    parts = sorted(p for p in (out / "shards").iterdir() if not p.name.startswith("."))
    assert len(parts) == 2  # rotated by --shard-samples 4
    ours = {r["__key__"]: r for r in records}
    if fmt == "webdataset":
        stream = webdataset.WebDataset([str(p) for p in parts], shardshuffle=False).decode().to_tuple("__key__", "npy")
        seen = dict(stream)
        assert seen.keys() == ours.keys()
        assert all(np.array_equal(v, ours[k]["latents"].float().numpy()) for k, v in seen.items())
    else:
        rows = [row for part in parts for row in pq.read_table(str(part)).to_pylist()]
        assert {row["id"] for row in rows} == ours.keys()
        for row in rows:
            latents = np.frombuffer(row["vae_latent_bytes"], dtype=np.float32).reshape(row["vae_latent_shape"])
            assert np.array_equal(latents, ours[row["id"]]["latents"].float().numpy())
            assert row["num_frames"] == 1 and row["media_type"] == "image"
    report = reconciled(make_plan(cfg))
    assert (report.ok, report.produced) == (True, count), report


def test_a_text_free_image_family_writes_webdataset_parts_without_text(tmp_path, source):
    spec, count = source
    out = tmp_path / "out"
    result = _build(_config(spec, _model(tmp_path, "none"), out, "webdataset"))
    assert result["done"] == count
    records = list(stream_samples(out))
    assert len(records) == count and all("text_embeddings" not in r or r["text_embeddings"] is None for r in records)
    assert all(list(r["latents"].shape) == LATENT for r in records)
