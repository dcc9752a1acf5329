"""LTX-2 with audio, end to end on real clips: a `dataset.json` the test writes, the tiny LTX-2 model (the real
diffusers classes), the LTX-2 trainer's `.precomputed` layout, the audio gate, and every step after the build.

Clips with an audio track: bigbuckbunny (AAC 5.1, 48 kHz) and pymediainfo's sample.mp4 (AAC stereo); without:
bikes. Geometry: buckets 96x64x9 and 64x64x9 (frames ≡ 1 mod 8, sides multiples of 32).
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from pathlib import Path

import boto3
import pytest
import torch
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.audit.audio_gate import audio_check
from infra.audit.decode_verify import decode_and_verify
from infra.audit.run_report import latest_run_report
from infra.cache import ledger
from infra.errors import InputError
from infra.gates.conflicts import overwrite_token
from infra.media.audio import trainer_audio
from infra.models import load_family
from infra.plan import make_plan
from infra.preprocess.prepare import prepare_video
from infra.publish.manifest import gate_problems
from tests import s3_server
from tests.conftest import config, tree_hashes
from tests.media_utils import cut_clip, trainer_dataset
from tests.steps import reconciled, verified

moto_server, s3_env = s3_server.moto_server, s3_server.s3_env
BUCKETS = "96x64x9;64x64x9"
CLIPS = {"bigbuckbunny": "a grey rabbit wakes up", "sample_1080p": "a deer grazes", "bikes": "cyclists in traffic"}
KEYS = {
    "latents": {"latents", "num_frames", "height", "width", "fps"},
    "conditions": {"video_prompt_embeds", "prompt_attention_mask", "audio_prompt_embeds"},
    "audio_latents": {"latents", "num_time_steps", "frequency_bins", "duration"},
}


def _config(dataset: Path, model: Path, out: Path, **overrides: object):
    values = {"source": f"meta:{dataset}", "format": "ltx", "audio": True, "buckets": BUCKETS, **overrides}
    return config(dataset.parent, model, out, **values)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, ltx2_model: Path) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("ltx2")
    dataset = trainer_dataset(root / "data", CLIPS)
    out = root / "out"
    ok, result = run_build(_config(dataset, ltx2_model, out, decode_samples=2))
    assert ok, result
    return dataset, out, result


def test_the_trainers_layout_keys_dtypes_and_shapes(built):
    _, out, result = built
    pre = out / ".precomputed"
    names = {kind: sorted(p.relative_to(pre / kind).as_posix() for p in (pre / kind).rglob("*.pt")) for kind in KEYS}
    assert names == {
        "latents": ["clips/bigbuckbunny.pt", "clips/bikes.pt", "clips/sample_1080p.pt"],
        "conditions": ["clips/bigbuckbunny.pt", "clips/bikes.pt", "clips/sample_1080p.pt"],
        "audio_latents": ["clips/bigbuckbunny.pt", "clips/sample_1080p.pt"],  # bikes has no audio track
    }
    for kind, files in names.items():
        for rel in files:
            record = torch.load(pre / kind / rel, weights_only=True)
            assert set(record) == KEYS[kind], (kind, rel)  # exactly the trainer's keys
    latents = torch.load(pre / "latents/clips/bigbuckbunny.pt", weights_only=True)
    assert latents["latents"].dtype == torch.bfloat16 and list(latents["latents"].shape) == [128, 2, 2, 3]
    assert (latents["num_frames"], latents["height"], latents["width"]) == (2, 2, 3) and latents["fps"] == 25.0
    assert isinstance(latents["num_frames"], int) and isinstance(latents["fps"], float)
    cond = torch.load(pre / "conditions/clips/bigbuckbunny.pt", weights_only=True)
    mask = cond["prompt_attention_mask"]
    assert cond["video_prompt_embeds"].dtype == torch.bfloat16 and list(cond["video_prompt_embeds"].shape) == [1024, 64]
    assert mask.dtype == torch.int64 and list(mask.shape) == [1024] and 1 < int(mask.sum()) < 1024
    assert mask[-1] == 1 and mask[0] == 0  # left padding: the real tokens are at the end
    assert torch.equal(cond["audio_prompt_embeds"], cond["video_prompt_embeds"])  # LTX-2.0: one tensor for both
    audio = torch.load(pre / "audio_latents/clips/bigbuckbunny.pt", weights_only=True)
    assert audio["latents"].dtype == torch.float32 and list(audio["latents"].shape) == [8, 10, 16]
    assert (audio["num_time_steps"], audio["frequency_bins"]) == (10, 16)
    assert audio["duration"] == int(9 / 25 * 48000) / 48000  # 9 frames at 25 fps, at the source's 48 kHz
    assert result["done"] == 3


def test_counts_per_kind_and_the_accepted_loss_of_the_silent_clip(built, ltx2_model):
    dataset, out, _ = built
    report = reconciled(make_plan(_config(dataset, ltx2_model, out)))
    (group,) = report.groups.values()
    assert group.kinds == {"latents": 3, "text_embeddings": 3, "audio_latents": 2}
    assert (report.expected, report.produced) == (3, 2)
    (missing,) = report.missing
    assert (missing.id, missing.reason) == ("clips/bikes.mp4", "no_audio_track")
    run = latest_run_report(out)
    (loss,) = run.decisions_at("loss")
    assert loss.choice == "accept_loss" and run.audio is not None and run.audio.ok
    assert [w["id"] for w in run.audio.without] == ["clips/bikes.mp4"]
    assert gate_problems(out, run.fingerprint) == []


def test_the_audio_latent_is_the_audio_vaes_mean_of_the_trainers_mel(built, ltx2_model):
    dataset, out, _ = built
    from diffusers import AutoencoderKLLTX2Audio  # noqa: PLC0415

    vae = AutoencoderKLLTX2Audio.from_pretrained(ltx2_model / "audio_vae", local_files_only=True).eval()
    mel, duration = trainer_audio((dataset.parent / "clips/bigbuckbunny.mp4").read_bytes(), 9 / 25)
    with torch.no_grad():
        z = vae.encode(mel.unsqueeze(0)).latent_dist.mean  # [1, 8, T', 16]
    expected = (z - vae.latents_mean.view(1, 8, 1, 16)) / vae.latents_std.view(1, 8, 1, 16)  # packed C·M order
    stored = torch.load(out / ".precomputed/audio_latents/clips/bigbuckbunny.pt", weights_only=True)
    torch.testing.assert_close(stored["latents"], expected[0], rtol=0, atol=1e-5)
    assert stored["duration"] == duration


def test_the_pre_connector_text_is_what_the_connectors_own_forward_feeds_its_transformers(ltx2_model):
    encoder = load_family(ltx2_model, "ltx2", torch.device("cpu"), torch.float32)
    from infra.models.base import TextSettings  # noqa: PLC0415

    prompt = "  a grey rabbit wakes up under a tree  "
    pre = encoder.encode_text(prompt, TextSettings(1024, "raw", "pre_connector"))
    seen = {}
    hook = encoder.connectors.text_proj_in.register_forward_hook(lambda m, i, o: seen.setdefault("out", o))
    try:
        tokens = encoder.tokenizer(
            [prompt.strip()], padding="max_length", max_length=1024, truncation=True, return_tensors="pt"
        )
        with torch.no_grad():
            hidden = encoder.text_encoder(**tokens, output_hidden_states=True).hidden_states
            full_video, _, _ = encoder.connectors(torch.stack(hidden, dim=-1).flatten(2, 3), tokens.attention_mask)
    finally:
        hook.remove()
    assert torch.equal(pre.embeds, seen["out"][0].to(torch.bfloat16))
    assert torch.equal(pre.extras["prompt_attention_mask"], tokens.attention_mask[0])
    post = encoder.encode_text(prompt, TextSettings(1024, "raw", "post_connector"))
    assert torch.equal(post.embeds, full_video[0].to(torch.bfloat16))
    assert int(post.extras["prompt_attention_mask"].sum()) == 1024  # the connectors' registers: all ones


def test_verify_resume_decode_and_the_card_work_for_the_layout(built, ltx2_model, tmp_path):
    dataset, out, _ = built
    report = verified(make_plan(_config(dataset, ltx2_model, out)))
    assert report.kind == "compatible" and report.problems == [] and report.stale == []
    assert report.outputs == {"latents": "present", "text_embeddings": "present", "audio_latents": "present"}
    decoded = decode_and_verify(out, n=None, device="cpu", report_dir=tmp_path / "decode")
    assert len(decoded.rows) == 3 and not decoded.problems
    by_id = {row.id: row for row in decoded.rows}
    assert by_id["clips/bikes.mp4"].audio_mel_l1 is None and by_id["clips/bigbuckbunny.mp4"].audio_mel_l1 > 0
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    before = tree_hashes(copy)
    ok, again = run_build(_config(dataset, ltx2_model, copy))
    assert ok and again["reused"] == 3 and again["encoded"] == 0, again
    assert {k: v for k, v in tree_hashes(copy).items() if not k.startswith("ledger")} == {
        k: v for k, v in before.items() if not k.startswith("ledger")
    }
    card = CliRunner().invoke(app, ["audio-check", str(copy)])
    assert card.exit_code == 0 and "2 of 3 done samples have audio" in card.output


def test_an_approved_overwrite_replaces_the_trainers_files(built, ltx2_model, tmp_path):
    dataset, out, result = built
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    before = tree_hashes(copy)
    changed = _config(dataset, ltx2_model, copy, text_max_length=512)  # post_connector: refused for this trainer
    ok, refused = run_build(changed)
    assert not ok and "holds another cache" in refused and tree_hashes(copy) == before  # no approval: nothing written
    token = overwrite_token(copy, result["fingerprint"], make_plan(changed).fingerprint)
    ok, replaced = run_build(changed.with_values(approve_overwrite=token))
    assert ok and replaced["encoded"] == 3, replaced
    after = tree_hashes(copy)
    conditions = [k for k in before if k.startswith(".precomputed/conditions/")]
    assert len(conditions) == 3 and all(after[k] != before[k] for k in conditions)
    assert any(k.startswith("cache.") and k != "cache.json" for k in after)  # the old cache.json kept beside


def test_the_layout_uploads_and_verifies(built, s3_env, tmp_path):
    _, out, _ = built
    bucket = f"lf-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    target = f"s3://{bucket}/ltx"
    sent = CliRunner().invoke(app, ["upload", str(out), "--to", target])
    assert sent.exit_code == 0, sent.output
    keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket)["Contents"]}
    assert "ltx/.precomputed/audio_latents/clips/sample_1080p.pt" in keys and "ltx/cache.json" in keys
    assert "ltx/.precomputed/audio_latents/clips/bikes.pt" not in keys
    verified = CliRunner().invoke(app, ["upload", str(out), "--to", target, "--verify-only"])
    counted = re.search(r"remote verified: (\d+) of (\d+) files", verified.output)
    assert verified.exit_code == 0 and counted and counted[1] == counted[2], verified.output
    assert sum(k.startswith("ltx/.precomputed/") for k in keys) == 8  # 3 latents, 3 conditions, 2 audio latents


def test_an_audio_run_over_silent_clips_stops_at_the_gate_and_its_printed_answer_builds_them_without_audio(
    tmp_path, ltx2_model
):
    dataset = trainer_dataset(tmp_path / "data", {"bikes": "cyclists in traffic"})
    out = tmp_path / "out"
    args = ["build", "--source", f"meta:{dataset}", "--model", str(ltx2_model), "--out", str(out), "--format", "ltx"]
    args += ["--audio", "--buckets", BUCKETS, "--device", "cpu", "--dtype", "fp32", "--decode-samples", "0"]
    args += ["--on-loss", "accept", "--on-conflict", "abort"]  # losses accepted: the audio gate holds all the same
    stopped = CliRunner().invoke(app, args)
    assert stopped.exit_code == 1, stopped.output[-3000:]
    (error,) = [line for line in stopped.output.splitlines() if line.startswith("error: ")]
    assert "audio gate: FAILED" in error and "audio decode path" in error
    audio = latest_run_report(out).audio
    assert audio is not None and not audio.ok and audio.with_audio == 0
    assert not audio_check(out).ok
    assert any("audio gate failed" in p for p in gate_problems(out, latest_run_report(out).fingerprint))

    answer = re.search(r"add (--skip-audio --approve-overwrite \w+) to the same command", error).group(1)
    silent = CliRunner().invoke(app, [*args, *answer.split()])  # as printed: the same command and those flags
    assert silent.exit_code == 0, silent.output[-3000:]
    assert "1 done (1 encoded now, 0 reused)" in silent.output and "audio gate" not in silent.output
    assert not json.loads((out / "cache.json").read_text())["spec"]["audio"]
    assert audio_check(out).headline() == "audio gate: not an audio run"


def test_a_clip_too_short_for_every_bucket_is_skipped_with_its_reason(tmp_path, ltx2_model, clips):
    short = cut_clip(clips["carphone"], 5)
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "short.mp4").write_bytes(short)
    (tmp_path / "clips" / "long.mp4").write_bytes(cut_clip(clips["carphone"], 9))
    rows = [{"video": "clips/short.mp4", "caption": "too short"}, {"video": "clips/long.mp4", "caption": "long enough"}]
    (tmp_path / "dataset.json").write_text(json.dumps(rows))
    spec = make_plan(_config(tmp_path / "dataset.json", ltx2_model, tmp_path / "out")).spec
    with pytest.raises(InputError, match=r"decodes to 5 frame\(s\); the shortest bucket, 96x64x9, needs 9") as info:
        prepare_video(short, spec)
    assert info.value.reason == "too_short_for_buckets"
    ok, result = run_build(_config(tmp_path / "dataset.json", ltx2_model, tmp_path / "out", audio=False))
    assert ok and result["skipped"] == 1, result  # the loss is accepted by the test's policy
    rows = ledger.read_shard(tmp_path / "out", "dataset-00000")
    assert (rows["clips/short.mp4"].status, rows["clips/short.mp4"].reason) == ("skipped", "too_short_for_buckets")
    assert "decodes to 5 frame(s)" in rows["clips/short.mp4"].detail and rows["clips/long.mp4"].status == "done"
