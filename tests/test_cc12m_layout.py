"""``--layout cc12m`` (the ``cc12m-wds`` recipe): webdataset exactly as the CC12M latent set publishes it — parts
named after their numbered source shard (``00000.tar``), members ``<key>.npy`` (float16) + ``<key>.txt`` only,
``_meta.json["samples"]`` the exact count of ``.npy`` members — read with the seed's own snippet and with
``webdataset.WebDataset(...).decode()``; latentforge's reader and decode-and-verify still work on it."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.errors import ConfigError
from infra.formats.stream import stream_samples
from infra.plan import make_plan
from tests.conftest import config
from tests.image_media import sample_images, write_wds

SIZE = 32
LATENT = (4, SIZE // 4, SIZE // 4)  # the tiny AutoencoderKL: 4 channels, 4x down, no frame axis


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cc12m-models")
    made = {}
    for text in ("none", "clip"):
        made[text] = root / f"kl-{text}"
        args = ["make-tiny-model", str(made[text]), "--family", "image", "--vae", "kl", "--text", text]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
    return made


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """Two numbered webdataset shards of real stills (CC12M's own source layout: 000.tar, 001.tar)."""
    images = sample_images()
    root = tmp_path_factory.mktemp("cc12m-src")
    write_wds(root / "000.tar", images[:3])
    write_wds(root / "001.tar", images[3:])
    return root, {image.key: image.caption for image in images}


def _config(src: Path, model: Path, out: Path, **overrides: object):
    values = {"source": f"wds:{src}", "family": None, "recipe": "cc12m-wds", "height": SIZE, "width": SIZE}
    return config(Path("-"), model, out, decode_samples=2, **{**values, **overrides})


def test_the_seed_snippet_reads_float16_latents_and_captions_from_numbered_parts(source, models, tmp_path):
    src, captions = source
    out = tmp_path / "out"
    ok, result = run_build(_config(src, models["none"], out))
    assert ok and result["done"] == len(captions), result
    parts = sorted(p.name for p in (out / "shards").iterdir() if not p.name.startswith("."))
    assert parts == ["00000.tar", "00001.tar"]
    urls = [str(out / "shards" / name) for name in parts]
    npy_members = 0
    for url in urls:  # members: <key>.npy + <key>.txt, nothing else
        with tarfile.open(url) as tar:
            names = tar.getnames()
        keys = {name.rsplit(".", 1)[0] for name in names}
        assert sorted(names) == sorted(f"{key}.{ext}" for key in keys for ext in ("npy", "txt"))
        npy_members += sum(name.endswith(".npy") for name in names)
    seen = {}
    for url in urls:  # the seed's own loading snippet
        for npy, txt in wds.WebDataset(url, shardshuffle=False).to_tuple("npy", "txt"):
            latent = np.load(io.BytesIO(npy))
            assert latent.dtype == np.float16 and latent.shape == LATENT
            seen[txt.decode("utf-8")] = latent
    assert set(seen) == set(captions.values())
    decoded = list(wds.WebDataset(urls, shardshuffle=False).decode())  # every member, webdataset's decoders
    assert len(decoded) == len(captions)
    for sample in decoded:
        assert set(sample) - {"__key__", "__url__", "__local_path__"} == {"npy", "txt"}
        assert np.array_equal(sample["npy"], seen[sample["txt"]])
    meta = json.loads((out / "_meta.json").read_text())
    fingerprint = json.loads((out / "cache.json").read_text())["fingerprint"]
    assert meta["samples"] == npy_members == len(captions) and meta["fingerprint"] == fingerprint
    streamed = list(stream_samples(out))  # latentforge's reader: fingerprint and dtype from beside the parts
    assert {s["fingerprint"] for s in streamed} == {fingerprint} and len(streamed) == len(captions)
    assert all(str(s["latents"].dtype) == "torch.float16" for s in streamed)


def test_the_layout_refuses_what_it_cannot_hold(source, models, tmp_path):
    src, _ = source
    with pytest.raises(ConfigError, match=r"stores <key>\.npy .* only.*text_embeddings"):
        make_plan(_config(src, models["clip"], tmp_path / "a"))
    named = tmp_path / "named"
    write_wds(named / "cats.tar", sample_images()[:1])
    with pytest.raises(ConfigError, match="shard 'cats' is not a number"):
        make_plan(_config(named, models["none"], tmp_path / "b"))
    with pytest.raises(ConfigError, match=r"stores float16 \.npy latents"):
        make_plan(_config(src, models["none"], tmp_path / "d", store_dtype="bf16"))
    with pytest.raises(ConfigError, match="not for --format parquet"):
        make_plan(_config(src, models["none"], tmp_path / "c", format="parquet"))
