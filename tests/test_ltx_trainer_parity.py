"""The ``ltx`` format against the LTX-2 trainer: a cache built by ``latentforge build`` with the tiny LTX-2 model
holds, file for file, the keys, Python types, dtypes and ranks that ``process_dataset.py`` writes, and a reader
that follows ``PrecomputedDataset``'s rules (`tests.ltx_precomputed`) loads every counted sample, with the
text-to-video strategy's sources, with and without audio. ``fps`` is the rate of the frames stored, as the
trainer stores ``source fps / temporal_subsample_factor``.

Clips: bigbuckbunny (AAC 5.1, 25 fps), sample_1080p in a nested folder (AAC stereo), bikes (no audio track), and
a PNG among them (the trainer's one-frame sample at fps 1.0).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import av
import pytest
import torch
from torch.utils.data import default_collate
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.cache import ledger
from infra.demo.testmedia import real_clip
from tests.conftest import config
from tests.image_media import small
from tests.ltx_precomputed import PrecomputedReader, t2v_sources

runner = CliRunner()
BUCKETS = "96x64x9;64x64x9;64x64x1"
MEDIA = {
    "clips/bigbuckbunny.mp4": "a grey rabbit wakes up",
    "clips/deer/sample_1080p.mp4": "a deer grazes",
    "clips/bikes.mp4": "cyclists in traffic",
    "stills/astronaut.png": "an astronaut",
}
#: What ``process_dataset.py`` writes per subfolder (Lightricks/LTX-2 400fd31, ``scripts/process_videos.py``:
#: ``compute_latents`` with ``_encode_video`` (VAE in bf16; sizes from ``latents.shape``; ``fps`` a float from
#: ``.item() / temporal_subsample_factor``) and ``_encode_audio`` (audio VAE in float32; ``duration`` samples /
#: rate); ``scripts/process_captions.py``: the text encoder in bf16, ``prompt_attention_mask`` the tokenizer's
#: int64 mask, ``audio_prompt_embeds`` where the feature extractor gives one (LTX-2.0 AV: the video tensor)).
#: key → a Python type, or (dtype, rank) of a tensor.
TRAINER_FILES: dict[str, dict[str, type | tuple[torch.dtype, int]]] = {
    "latents": {"latents": (torch.bfloat16, 4), "num_frames": int, "height": int, "width": int, "fps": float},
    "conditions": {
        "video_prompt_embeds": (torch.bfloat16, 2),
        "prompt_attention_mask": (torch.int64, 1),
        "audio_prompt_embeds": (torch.bfloat16, 2),
    },
    "audio_latents": {"latents": (torch.float32, 3), "num_time_steps": int, "frequency_bins": int, "duration": float},
}
#: The tiny model's text: Gemma padded to 1024 tokens, connectors' input width 64.
TEXT_ROWS, TEXT_WIDTH = 1024, 64


def _dataset(root: Path) -> Path:
    for rel in MEDIA:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
    for rel in MEDIA:
        if rel.endswith(".mp4"):
            shutil.copy(real_clip(Path(rel).stem), root / rel)
    small("astronaut", 80).crop((0, 0, 80, 64)).save(root / "stills/astronaut.png")
    path = root / "dataset.json"
    path.write_text(json.dumps([{"video": rel, "caption": caption} for rel, caption in MEDIA.items()]))
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, ltx2_model: Path) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("ltx-parity")
    dataset, out = _dataset(root / "data"), root / "out"
    args = ["build", "--source", f"meta:{dataset}", "--model", str(ltx2_model), "--out", str(out)]
    args += ["--format", "ltx", "--audio", "--buckets", BUCKETS, "--temporal", "head", "--device", "cpu"]
    args += ["--dtype", "fp32", "--decode-samples", "0", "--on-conflict", "abort", "--on-loss", "accept"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = {row.id: row for shard in ledger.read_all(out).values() for row in shard.values()}
    return out, rows


def _stream_fps(out: Path, rel: str) -> float:
    """The rate the trainer reads: the stream's average rate (``read_video``), 1.0 for an image."""
    if rel.endswith(".png"):
        return 1.0
    with av.open(str(out.parent / "data" / rel)) as container:
        return float(container.streams.video[0].average_rate)


def _matches_trainer(folder: str, record: dict) -> None:
    expected = TRAINER_FILES[folder]
    assert set(record) == set(expected), (folder, sorted(record))  # key for key, nothing more
    for key, kind in expected.items():
        value = record[key]
        if isinstance(kind, tuple):
            assert isinstance(value, torch.Tensor) and (value.dtype, value.dim()) == kind, (folder, key, value.dtype)
        else:
            assert type(value) is kind, (folder, key, type(value))  # int is not a tensor, float is not an int


def test_every_counted_sample_loads_by_the_trainers_rules_key_for_key(built):
    out, rows = built
    done = {rid: row for rid, row in rows.items() if row.status == "done"}
    assert sorted(done) == sorted(MEDIA)  # every sample counted
    stems = {str(Path(rid).with_suffix(".pt")) for rid in done}
    video_only = PrecomputedReader(out, t2v_sources(with_audio=False))
    assert set(video_only.relative_paths) == stems and len(video_only) == len(done)
    with_audio = PrecomputedReader(out, t2v_sources(with_audio=True))
    voiced = {str(Path(rid).with_suffix(".pt")) for rid, row in done.items() if "audio_latents" not in row.missing}
    assert set(with_audio.relative_paths) == voiced == {"clips/bigbuckbunny.pt", "clips/deer/sample_1080p.pt"}
    native_fps = {rid: _stream_fps(out, rid) for rid in done}
    for reader in (video_only, with_audio):
        for index in range(len(reader)):
            item = reader[index]
            row = done[next(rid for rid in done if str(Path(rid).with_suffix(".pt")) == reader.relative_paths[index])]
            latents, conditions = item["latents"], item["conditions"]
            _matches_trainer("latents", latents)
            _matches_trainer("conditions", conditions)
            shape = list(latents["latents"].shape)
            assert shape == row.latent_shape and shape[1:] == [latents[k] for k in ("num_frames", "height", "width")]
            mask = conditions["prompt_attention_mask"]
            assert list(conditions["video_prompt_embeds"].shape) == [TEXT_ROWS, TEXT_WIDTH] and mask.shape == (1024,)
            assert int(mask.sum()) == row.seq_len and mask[-1] == 1 and mask[0] == 0  # left padding, 1 = real
            assert latents["fps"] == native_fps[row.id]  # head: every frame, the stream's rate (a still: 1.0)
            if "audio_latents" in item:
                audio = item["audio_latents"]
                _matches_trainer("audio_latents", audio)
                assert list(audio["latents"].shape[1:]) == [audio["num_time_steps"], audio["frequency_bins"]]
            batch = default_collate([item])  # the trainer's DataLoader; the strategy reads sizes with .item()
            assert batch["latents"]["num_frames"][0].item() == latents["num_frames"]


def test_the_readers_rules_drop_a_sample_missing_from_a_source(built, tmp_path):
    out, _ = built
    copy = tmp_path / "copy"
    shutil.copytree(out / ".precomputed", copy / ".precomputed")
    (copy / ".precomputed/conditions/clips/bikes.pt").unlink()
    reader = PrecomputedReader(copy, t2v_sources())
    assert "clips/bikes.pt" not in reader.relative_paths and len(reader) == len(MEDIA) - 1
    with pytest.raises(FileNotFoundError, match="audio_latents"):
        shutil.rmtree(copy / ".precomputed/audio_latents")
        PrecomputedReader(copy, t2v_sources(with_audio=True))


@pytest.mark.parametrize(("temporal", "fps"), [("stride:2", 12.5), ("fps:12", 12.0), ("head", 25.0)])
def test_fps_is_the_rate_of_the_frames_stored(tmp_path, ltx2_model, temporal, fps):
    (tmp_path / "data/clips").mkdir(parents=True)
    shutil.copy(real_clip("bigbuckbunny"), tmp_path / "data/clips/bigbuckbunny.mp4")
    dataset = tmp_path / "data/dataset.json"
    dataset.write_text(json.dumps([{"video": "clips/bigbuckbunny.mp4", "caption": "a grey rabbit"}]))
    values = {"source": f"meta:{dataset}", "format": "ltx", "temporal": temporal, "frames": 9}
    ok, result = run_build(config(dataset.parent, ltx2_model, tmp_path / "out", height=64, width=64, **values))
    assert ok and result["done"] == 1, result
    (item,) = [PrecomputedReader(tmp_path / "out", t2v_sources())[0]]
    assert item["latents"]["fps"] == fps  # stride:2 is the trainer's temporal_subsample_factor 2: 25 / 2
