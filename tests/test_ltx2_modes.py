"""The LTX-2 trainer's behaviour, through the public interface, with the tiny LTX-2 model and real clips: audio by
default in the `ltx2-trainer` recipe (`--skip-audio` / `--no-audio`), its caption handling (`--lora-trigger`,
`--remove-llm-prefixes`, empty captions, a media file listed twice, column overrides), and `--mode` (the output
kinds each mode requires; a dataset without a role its mode reads refused at plan time).

Clips: bigbuckbunny (AAC 5.1) has an audio track, bikes has none; carphone is used video-only.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.audit.audio_gate import audio_check
from infra.cache import ledger
from infra.config import CacheSpec
from infra.errors import ConfigError, InputError, SourceError
from infra.media.prompts import LLM_START_PHRASES, CaptionRules
from infra.media.resize import resize_pixels
from infra.models import get_family
from infra.models.ltx2_modes import MODE_ROLES
from infra.plan import make_plan, make_spec
from infra.preprocess.prepare import prepare_video
from infra.preprocess.read import read
from infra.sources import open_source
from tests.conftest import config
from tests.image_media import small
from tests.media_utils import trainer_dataset
from tests.steps import reconciled

runner = CliRunner()
BUCKETS = "64x64x9"


def _config(dataset: Path, model: Path, out: Path, **overrides: object):
    values = {"source": f"meta:{dataset}", "recipe": "ltx2-trainer", "buckets": BUCKETS, **overrides}
    return config(dataset.parent, model, out, **values)


def _listed(source) -> list:
    return [ref for shard in source.shards() for ref in source.samples(shard)]


def _refs(plan) -> list:
    return _listed(open_source(plan.config.source, plan.spec))


# --- (3) audio as the trainer does it ---------------------------------------------------------------------------


def test_the_trainer_recipe_encodes_audio_wherever_a_clip_has_a_track(tmp_path, ltx2_model):
    rows = [
        {"video": "clips/bigbuckbunny.mp4", "caption": "a rabbit"},
        {"video": "clips/bikes.mp4", "caption": "bikes"},
    ]
    dataset = trainer_dataset(tmp_path / "data", ("bigbuckbunny", "bikes"), rows)
    out = tmp_path / "out"
    plan = make_plan(_config(dataset, ltx2_model, out))
    assert plan.spec.audio and plan.job.kinds == ("latents", "text_embeddings", "audio_latents")  # no --audio given
    ok, result = run_build(_config(dataset, ltx2_model, out))
    assert ok and result["done"] == 2, result
    pre = out / ".precomputed"
    assert sorted(p.name for p in (pre / "audio_latents/clips").iterdir()) == ["bigbuckbunny.pt"]
    assert sorted(p.name for p in (pre / "latents/clips").iterdir()) == ["bigbuckbunny.pt", "bikes.pt"]
    # the clip without a track: missing from audio_latents/ by name (the trainer's loader would drop it)
    report = reconciled(plan)
    (missing,) = report.missing
    assert (missing.id, missing.reason) == ("clips/bikes.mp4", "no_audio_track")
    gate = audio_check(out)
    assert gate.ok and [w.id for w in gate.without] == ["clips/bikes.mp4"]
    # the flags: --skip-audio and --no-audio are one setting, and it is in the fingerprint
    same = runner.invoke(app, ["verify", str(out), "--model", str(ltx2_model)])
    assert same.exit_code == 0, same.output
    for flag in ("--skip-audio", "--no-audio"):
        other = runner.invoke(app, ["verify", str(out), "--model", str(ltx2_model), flag])
        assert other.exit_code != 0 and "audio" in other.output, (flag, other.output)
    # a sample missing from one required subfolder: named with the subfolder
    (pre / "conditions/clips/bigbuckbunny.pt").unlink()
    gone = {m.id: m for m in reconciled(plan).missing}["clips/bigbuckbunny.mp4"]
    assert gone.reason == "file_missing" and ".precomputed/conditions/clips/bigbuckbunny.pt" in gone.detail


def test_skip_audio_writes_no_audio_and_the_gate_holds_for_every_mode_with_audio(tmp_path, ltx2_model):
    dataset = trainer_dataset(tmp_path / "data", ("bikes",), [{"video": "clips/bikes.mp4", "caption": "bikes"}])
    skipped = _config(dataset, ltx2_model, tmp_path / "skip", audio=False)
    assert not make_plan(skipped).spec.audio
    ok, result = run_build(skipped)
    assert ok and not (tmp_path / "skip/.precomputed/audio_latents").exists(), result
    assert audio_check(tmp_path / "skip").headline() == "audio gate: not an audio run"
    for mode in ("t2v", "a2v"):  # silent clips in a mode with audio: a hard stop, whatever --on-loss says
        ok, result = run_build(_config(dataset, ltx2_model, tmp_path / mode, mode=mode, on_loss="accept"))
        answer = "add --skip-audio --approve-overwrite" if mode == "t2v" else f"--mode {mode} trains on audio"
        assert not ok and "audio gate: FAILED" in result and answer in result, (mode, result)
    with pytest.raises(ConfigError, match="--mode a2v trains on audio"):
        make_spec(_config(dataset, ltx2_model, tmp_path / "o", mode="a2v", audio=False))


# --- (4) captions as the trainer handles them ------------------------------------------------------------------


def test_the_trainers_llm_openings_and_trigger():
    assert len(LLM_START_PHRASES) == 68 and LLM_START_PHRASES[:2] == ("In the video,", "In this video,")
    assert "The picture presents" in LLM_START_PHRASES and "This video shows" in LLM_START_PHRASES


def test_trigger_prefixes_empty_captions_and_the_last_of_duplicated_rows_as_the_trainer(tmp_path, ltx2_model):
    trainer_rows = [
        {"video": "clips/carphone.mp4", "caption": "an old caption"},
        {"video": "clips/bikes.mp4", "caption": ""},
        {"video": "clips/carphone.mp4", "caption": "  The video shows a man on the phone "},
    ]
    dataset = trainer_dataset(tmp_path / "trainer", ("carphone", "bikes"), trainer_rows)
    options = {
        "lora_trigger": " sks ",
        "remove_llm_prefixes": True,
        "empty_captions": "encode",
        "duplicate_rows": "last",
        "audio": False,
    }
    plan = make_plan(_config(dataset, ltx2_model, tmp_path / "out", **options))
    refs = _refs(plan)
    rules = CaptionRules.of(plan.spec)
    assert [r.stem for r in refs] == ["", "clips/bikes", "clips/carphone"]
    with pytest.raises(InputError, match="listed again in row 3") as superseded:
        read(refs[0], rules)
    assert superseded.value.reason == "superseded"
    assert [read(r, rules).prompt for r in refs[1:]] == ["sks ", "sks a man on the phone"]  # the trainer's strings
    with pytest.raises(InputError, match="empty"):  # latentforge's default: an empty caption is skipped
        read(refs[1], CaptionRules())
    ok, result = run_build(_config(dataset, ltx2_model, tmp_path / "out", **options))
    assert ok and result["done"] == 2 and result["skipped"] == 1, result
    rows = ledger.read_shard(tmp_path / "out", "dataset-00000")
    assert rows["row-00000001"].reason == "superseded"
    # the same prompts spelled out, without the options: the same conditions (so the options reach the encoder)
    plain_rows = [
        {"video": "clips/carphone.mp4", "caption": "sks a man on the phone"},
        {"video": "clips/bikes.mp4", "caption": "sks"},
    ]
    plain = trainer_dataset(tmp_path / "plain", ("carphone", "bikes"), plain_rows)
    ok, result = run_build(_config(plain, ltx2_model, tmp_path / "plain-out", audio=False))
    assert ok, result
    for stem in ("carphone", "bikes"):
        ours = torch.load(tmp_path / f"out/.precomputed/conditions/clips/{stem}.pt", weights_only=True)
        theirs = torch.load(tmp_path / f"plain-out/.precomputed/conditions/clips/{stem}.pt", weights_only=True)
        assert torch.equal(ours["video_prompt_embeds"], theirs["video_prompt_embeds"]), stem


def test_caption_settings_are_in_the_fingerprint_and_their_defaults_keep_old_ones(tmp_path, ltx2_model):
    dataset = trainer_dataset(tmp_path / "data", (), [{"video": "clips/bikes.mp4", "caption": "bikes"}])
    base = make_spec(_config(dataset, ltx2_model, tmp_path / "o"))[1]
    canonical = base.canonical()
    new = ("mode", "lora_trigger", "remove_llm_prefixes", "empty_captions", "duplicate_rows", "video_column")
    assert not set(new) & set(canonical)  # absent at their defaults: a cache made before keeps its fingerprint
    written_before = {k: v for k, v in base.model_dump().items() if k not in (*new, "caption_column")}
    assert CacheSpec.model_validate(written_before).fingerprint() == base.fingerprint()
    changed = {
        "lora_trigger": "sks",
        "remove_llm_prefixes": True,
        "empty_captions": "encode",
        "duplicate_rows": "last",
        "mode": "i2v",
        "caption_column": "caption",
    }
    prints = {
        make_spec(_config(dataset, ltx2_model, tmp_path / "o", **{k: v}))[1].fingerprint() for k, v in changed.items()
    }
    assert len(prints) == len(changed) and base.fingerprint() not in prints


def test_column_overrides_and_an_unknown_column(tmp_path):
    rows = [{"clip": "clips/a.mp4", "video": "clips/b.mp4", "text": "from text", "caption": "from caption"}]
    dataset = tmp_path / "d.json"
    dataset.write_text(json.dumps(rows))
    (ref,) = _listed(open_source(f"meta:{dataset}"))
    assert (ref.id, ref.read_prompt()) == ("clips/b.mp4", b"from caption")  # the trainer's names first

    class Names:
        video_column, caption_column = "clip", "text"

    (ref,) = _listed(open_source(f"meta:{dataset}", Names()))
    assert (ref.id, ref.read_prompt()) == ("clips/a.mp4", b"from text")

    class Wrong:
        video_column = "nope"

    with pytest.raises(SourceError, match="--video-column 'nope'"):
        open_source(f"meta:{dataset}", Wrong()).shards()


# --- (1) modes ---------------------------------------------------------------------------------------------------


def test_each_mode_requires_its_subfolders_and_a_dataset_without_a_role_is_refused(tmp_path, ltx2_model):
    dataset = trainer_dataset(tmp_path / "data", (), [{"video": "clips/bikes.mp4", "caption": "bikes"}])
    family = get_family("ltx2")
    kinds = {mode: family.kinds(CacheSpec.model_construct(mode=mode, audio=False)) for mode in MODE_ROLES}
    assert kinds["t2v"] == kinds["i2v"] == ("latents", "text_embeddings")
    assert kinds["t2a"] == ("text_embeddings", "audio_latents")  # no latents/ in an audio-only mode
    assert "reference_latents" in kinds["v2v-ic-lora"] and "reference_audio_latents" in kinds["av2av-ic-lora"]
    assert kinds["video-inpaint"][-1] == "video_masks" and kinds["audio-inpaint"][-1] == "audio_masks"
    for mode in ("i2v", "a2v", "v2a"):
        spec = make_spec(_config(dataset, ltx2_model, tmp_path / "o", mode=mode))[1]
        assert family.kinds(spec) == ("latents", "text_embeddings", "audio_latents"), mode
    with pytest.raises(ConfigError, match="for --format ltx"):
        make_spec(_config(dataset, ltx2_model, tmp_path / "o", mode="i2v", format="pt"))
    # every mode plans; a dataset without a column its mode reads is refused when the plan lists it (exit 2)
    for mode in MODE_ROLES:
        assert make_spec(_config(dataset, ltx2_model, tmp_path / "o", mode=mode))[1].mode == mode
    needed = {"v2v-ic-lora": "reference_video", "video-inpaint": "video_mask", "t2a": "column 'audio'"}
    for mode, needs in needed.items():
        with pytest.raises(SourceError, match=needs):
            make_plan(_config(dataset, ltx2_model, tmp_path / "o", mode=mode))
    where = ["--source", f"meta:{dataset}", "--model", str(ltx2_model), "--out", str(tmp_path / "cli")]
    flags = ["--recipe", "ltx2-trainer", "--buckets", BUCKETS, "--device", "cpu", "--mode", "av2av-ic-lora"]
    refused = runner.invoke(app, ["build", *where, *flags])
    assert refused.exit_code == 2 and "reference_video" in refused.output, refused.output
    assert not (tmp_path / "cli").exists()


def test_an_image_among_clips_is_a_one_frame_sample_at_fps_one(tmp_path, ltx2_model):
    image = small("astronaut", 80).crop((0, 0, 80, 64))  # not square: the cover-crop shows
    (tmp_path / "data/stills").mkdir(parents=True)
    image.save(tmp_path / "data/stills/astronaut.png")
    rows = [{"video": "stills/astronaut.png", "caption": "an astronaut"}]
    dataset = trainer_dataset(tmp_path / "data", (), rows)
    cfg = _config(dataset, ltx2_model, tmp_path / "out", buckets="64x64x9;64x64x1", audio=False)
    spec = make_plan(cfg).spec
    prepared = prepare_video((tmp_path / "data/stills/astronaut.png").read_bytes(), spec)
    assert prepared.bucket is not None and prepared.bucket.frames == 1 and prepared.clip.fps == 1.0
    expected = resize_pixels(np.asarray(image.convert("RGB"))[None], 64, 64, "cover-crop")  # the clips' resize
    assert torch.equal(prepared.pixels, expected)
    ok, result = run_build(cfg)
    assert ok and result["done"] == 1, result
    latents = torch.load(tmp_path / "out/.precomputed/latents/stills/astronaut.pt", weights_only=True)
    assert list(latents["latents"].shape) == [128, 1, 2, 2] and latents["num_frames"] == 1 and latents["fps"] == 1.0
    with pytest.raises(InputError, match=r"decodes to 1 frame\(s\)"):  # no one-frame bucket: skipped as short
        prepare_video(
            (tmp_path / "data/stills/astronaut.png").read_bytes(),
            make_plan(_config(dataset, ltx2_model, tmp_path / "o2", audio=False)).spec,
        )


def test_a_separate_audio_file_follows_the_trainers_length_rule(tmp_path, ltx2_model):
    rows = [
        {"video": "clips/carphone.mp4", "audio": "clips/bigbuckbunny.mp4", "caption": "a call"},  # 29.97 fps video
        {"video": "clips/bikes.mp4", "audio": "clips/audio_only.mp4", "caption": "bikes"},  # 46 ms of audio
    ]
    dataset = trainer_dataset(tmp_path / "data", ("carphone", "bigbuckbunny", "bikes", "audio_only"), rows)
    assert make_plan(_config(dataset, ltx2_model, tmp_path / "o")).spec.audio_file_length == "trainer"
    ok, result = run_build(_config(dataset, ltx2_model, tmp_path / "out"))
    assert ok and result["done"] == 2, result
    pre = tmp_path / "out/.precomputed/audio_latents/clips"
    long = torch.load(pre / "carphone.pt", weights_only=True)
    assert long["duration"] == int(9 / 25 * 48000) / 48000  # the bucket's 9 frames / 25, not 9 / 29.97
    short = torch.load(pre / "bikes.pt", weights_only=True)
    assert short["duration"] < 0.1  # trimmed only: the 46 ms file is not padded to 0.36 s
