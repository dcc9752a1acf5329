"""Memory options: ``--vae-tiling`` changes the numbers, so it is in the fingerprint and a cache made without it is
not resumed with it; ``--text-offload`` leaves every byte as it was and the text encoder parked (freed on CPU, loaded
again for the next shard); ``--text-quantize int8-dynamic`` changes only the text embeddings, and the fingerprint."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from flows.cli import app
from infra.cache import ledger
from infra.errors import QuantizeOffCpu
from infra.models import LOAD_LOG_ENV, _load, memory
from infra.plan import make_plan
from infra.preprocess.encode import load_encoder
from infra.preprocess.shard import process_shard
from tests.conftest import config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip

#: Wider than the Wan2.2 VAE's tile (256 after its 2×2 patchify: 512 pixels): each frame in two overlapping tiles.
TILED = {"frames": 5, "height": 48, "width": 528}
PROMPTS = (b"a ball rolls to the left", b"an object hides and comes back", b"a ball rolls to the left")


@pytest.fixture(scope="module")
def source(tmp_path_factory, clips):
    good = [cut_clip(clips[name], 8, width=160) for name in ("bikes", "carphone", "bigbuckbunny")]
    samples = [sample(0, i, video, PROMPTS[i]) for i, video in enumerate(good)]
    return make_shards(tmp_path_factory.mktemp("memory") / "src", {"mem": samples})


def _build(source, model, out, **options):
    plan = make_plan(config(source, model, out, **options))
    result = process_shard(plan.job, plan.shards[0])
    assert result.counts == {"done": len(PROMPTS)}, result
    rows = ledger.read_shard(out, "mem")
    return plan, {k: torch.load(out / r.path, weights_only=True) for k, r in sorted(rows.items())}, result


def _pt_hashes(out):
    return {k: v for k, v in tree_hashes(out).items() if k.endswith(".pt")}


def test_vae_tiling_is_in_the_fingerprint_and_refused_on_a_cache_made_without(tmp_path, tiny_model, source) -> None:
    plain_plan, plain, _ = _build(source, tiny_model, tmp_path / "plain", **TILED)
    tiled_plan, tiled, _ = _build(source, tiny_model, tmp_path / "tiled", vae_tiling=True, **TILED)
    assert tiled_plan.fingerprint != plain_plan.fingerprint and tiled_plan.spec.vae_tiling
    diffs = [(tiled[k]["x0"].float() - plain[k]["x0"].float()).abs().max() for k in plain]
    assert all(d > 0 for d in diffs)  # tiles blended at their seams: other numbers
    out = tmp_path / "plain"
    args = ["build", "--source", f"vbvr:{source}", "--model", str(tiny_model), "--out", str(out), "--device", "cpu"]
    args += ["--dtype", "fp32", "--frames", "5", "--height", "48", "--width", "528", "--decode-samples", "0"]
    before = tree_hashes(out)
    done = CliRunner().invoke(app, [*args, "--vae-tiling", "--on-conflict", "abort"])
    assert done.exit_code != 0 and "vae_tiling" in done.output, done.output
    assert tree_hashes(out) == before  # nothing written over the untiled cache


def test_text_offload_leaves_every_byte_and_parks_the_encoder(tmp_path, tiny_model, source) -> None:
    _, kept, _ = _build(source, tiny_model, tmp_path / "kept")
    plan, _, result = _build(source, tiny_model, tmp_path / "off", text_offload=True)
    encoder = load_encoder(plan.job)
    assert memory.is_parked(encoder) and encoder.text_encoder is None  # freed on CPU while the VAE ran
    assert (result.text_calls, result.prompts_encoded) == (1, 2)  # both distinct prompts, before any video
    assert _pt_hashes(tmp_path / "off") == _pt_hashes(tmp_path / "kept")  # the same bytes, file for file
    _, again, _ = _build(source, tiny_model, tmp_path / "again", text_offload=True)  # loaded again from its files
    for key, stored in kept.items():
        assert torch.equal(again[key]["text_embeds"], stored["text_embeds"])


def test_text_quantize_int8_changes_only_text_and_the_fingerprint(tmp_path, tiny_model, source) -> None:
    plain_plan, plain, _ = _build(source, tiny_model, tmp_path / "plain")
    int8_plan, int8, _ = _build(source, tiny_model, tmp_path / "int8", text_quantize="int8-dynamic")
    assert int8_plan.fingerprint != plain_plan.fingerprint
    assert int8_plan.spec.text_quantize == "int8-dynamic"
    for key, stored in plain.items():
        assert torch.equal(int8[key]["x0"], stored["x0"])
        a, b = int8[key]["text_embeds"].float(), stored["text_embeds"].float()
        assert not torch.equal(a, b)
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.9


def test_int8_text_on_a_device_auto_resolved_to_an_accelerator_is_refused_at_the_load() -> None:
    """With ``--device auto`` the config cannot know the device; the load refuses int8 once it is an accelerator
    (the config's own refusal, for a device named up front: `tests/test_cli.py`), the text encoder untouched."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    for device in ("cuda", "xla"):
        with pytest.raises(QuantizeOffCpu, match=f"on {device} there is no 8-bit text encoder"):
            memory.quantized(model, SimpleNamespace(device=torch.device(device)))
    assert isinstance(model[0], torch.nn.Linear) and model[0].weight.dtype == torch.float32
    assert type(memory.quantized(model, SimpleNamespace(device=torch.device("cpu")))[0]) is not torch.nn.Linear


def test_decode_and_verify_reuses_the_family_the_build_loaded_with_its_options(
    tmp_path, tiny_model, source, monkeypatch
) -> None:
    loads = tmp_path / "loads"
    loads.mkdir()
    monkeypatch.setenv(LOAD_LOG_ENV, str(loads))
    _load.cache_clear()  # count this build's loads from nothing
    out = tmp_path / "out"
    args = ["build", "--source", f"vbvr:{source}", "--model", str(tiny_model), "--out", str(out), "--device", "cpu"]
    args += ["--dtype", "fp32", "--frames", "5", "--height", "48", "--width", "528", "--on-conflict", "abort"]
    done = CliRunner().invoke(app, [*args, "--vae-tiling", "--text-offload", "--decode-samples", "1"])
    assert done.exit_code == 0, done.output
    (saved,) = (json.loads(p.read_text()) for p in out.glob("reports/decode/**/report.json"))
    assert len(saved["rows"]) == 1 and not saved["problems"], saved  # decoded with the tiled VAE it was built with
    assert [p.read_text().splitlines() for p in loads.iterdir()] == [[f"wan22 {tiny_model.resolve()}"]]
