"""The command line: build through flags and a config file, geometry errors, inspect, make-tiny-model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import typer
from typer.testing import CliRunner

from flows.cli import app
from infra.config import SECTIONS, BuildConfig, merge_config, step_settings
from infra.demo.tiny import make_tiny_wan22
from infra.models import load_family, model_identity, resolve_family
from infra.models.base import TextSettings
from infra.models.wan_constants import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD
from tests.conftest import FRAMES, HEIGHT, WIDTH, make_shards, sample
from tests.media_utils import cut_clip

runner = CliRunner()


def _flags(src, model, out, *extra: str) -> list[str]:
    return ["build", "--source", f"vbvr:{src}", "--model", str(model), "--out", str(out), "--device", "cpu", *extra]


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--frames", "32", "frames=32"),
        ("--frames", "30", "29 or 33"),
        ("--height", "50", "48 or 64"),
        ("--width", "8", "16"),
    ],
)
def test_geometry_errors_name_the_value_and_the_nearest_valid_ones(tmp_path, tiny_model, flag, value, named):
    src = make_shards(tmp_path / "src", {"s": [sample(0, 0, b"x", b"p")]})
    result = runner.invoke(app, _flags(src, tiny_model, tmp_path / "out", flag, value))
    assert result.exit_code == 2
    assert named in result.output and "geometry not valid for family wan22" in result.output
    assert not (tmp_path / "out").exists()


def test_int8_text_on_an_accelerator_is_refused_before_anything_runs(tmp_path, tiny_model):
    """``--text-quantize int8-dynamic`` is CPU-only: with ``--device cuda`` or ``neuron`` named, the build is refused
    by its config (exit 2, naming both remedies), before a server, a model or OUT exists; on CPU it is accepted."""
    src = make_shards(tmp_path / "src", {"s": [sample(0, 0, b"x", b"p")]})
    for device in ("cuda", "neuron"):
        flags = _flags(src, tiny_model, tmp_path / "out", "--text-quantize", "int8-dynamic")
        flags[flags.index("--device") + 1] = device
        result = runner.invoke(app, flags)
        assert result.exit_code == 2, result.output
        assert f"CPU dynamic quantization; on {device}" in result.output and "--device cpu" in result.output
        assert not (tmp_path / "out").exists()
    for device in ("cpu", "auto"):
        kept = BuildConfig(source=f"vbvr:{src}", model=str(tiny_model), out=str(tmp_path / "o"), device=device,
                           text_quantize="int8-dynamic")  # fmt: skip
        assert kept.encoding.text_quantize == "int8-dynamic"


def test_config_file_with_flags_winning(tmp_path, tiny_model, clips):
    video = cut_clip(clips["carphone"], 9)
    src = make_shards(tmp_path / "src", {"s": [sample(0, i, video, b"a man talks") for i in range(3)]})
    cfg = tmp_path / "cache.yaml"
    cfg.write_text(
        f"source: vbvr:{src}\nmodel: {tiny_model}\nout: {tmp_path / 'ignored'}\nframes: {FRAMES}\n"
        f"height: {HEIGHT}\nwidth: {WIDTH}\ndevice: cpu\ndtype: fp32\nmax-samples-per-shard: 2\n"
    )
    out = tmp_path / "out"
    result = runner.invoke(app, ["build", "--config", str(cfg), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 done" in result.output and not (tmp_path / "ignored").exists()
    report = runner.invoke(app, ["inspect", str(out), "--json"])
    data = json.loads(report.output)
    group = sample(0, 0, None, None).generator
    assert data["groups"] == {group: {"done": 2}}
    assert data["samples"][group]["x0"] == {"shape": [48, 5, 3, 5], "dtype": "bfloat16"}
    (geometry,) = data["geometry"]
    assert [geometry[k] for k in ("frames", "height", "width", "samples")] == [FRAMES, HEIGHT, WIDTH, 2]
    assert geometry["outputs"]["x0"] == {"shape": [48, 5, 3, 5], "dtype": "bfloat16"} and data["buckets"] == []
    text = runner.invoke(app, ["inspect", str(out)])
    assert data["fingerprint"] in text.output and group in text.output


def test_unknown_config_keys_are_errors(tmp_path):
    with pytest.raises(ValueError, match="framez"):
        merge_config({"source": "vbvr:x", "model": "m", "out": "o", "framez": 33}, {})
    cfg = tmp_path / "c.yaml"
    cfg.write_text("source: vbvr:/x\nmodel: /m\nout: /o\nframez: 33\n")
    result = runner.invoke(app, ["build", "--config", str(cfg)])
    assert result.exit_code == 2 and "framez" in result.output


def test_flat_keys_go_to_their_sections_and_the_nested_form_is_the_same_config(tmp_path):
    flat = {"source": "vbvr:a", "model": "m", "out": "o", "frames": 21, "on_loss": "accept", "device": "cpu"}
    nested = {"source": "vbvr:a", "model": "m", "out": "o", "encoding": {"frames": 21}}
    nested |= {"gates": {"on_loss": "accept"}, "run": {"device": "cpu"}}
    config = BuildConfig.model_validate(flat)
    assert config == BuildConfig.model_validate(nested) == BuildConfig.model_validate(config.model_dump())
    assert (config.encoding.frames, config.gates.on_loss, config.run.device) == (21, "accept", "cpu")
    assert BuildConfig.model_validate({**nested, "frames": 9}).encoding.frames == 9  # a flat key wins
    names = [name for section in SECTIONS.values() for name in section.model_fields]
    assert len(names) == len(set(names)) and not set(names) & set(BuildConfig.model_fields)  # one place each
    assert list(BuildConfig.settings()) == [*step_settings("build")]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("source: vbvr:/x\nmodel: /m\nout: /o\nframes: 0\n")
    result = runner.invoke(app, ["build", "--config", str(cfg)])
    assert result.exit_code == 2 and "invalid configuration: frames = 0 (--frames): " in result.output  # as given
    cfg.write_text("source: vbvr:/x\nmodel: /m\nout: /o\nencoding: {framez: 3}\n")
    result = runner.invoke(app, ["build", "--config", str(cfg)])
    assert result.exit_code == 2 and "framez" in result.output


def test_flags_override_the_file_and_unset_flags_do_not():
    merged = merge_config({"source": "vbvr:a", "model": "m", "out": "o", "frames": 21}, {"frames": None, "out": "p"})
    assert (merged.encoding.frames, merged.out, merged.encoding.height) == (21, "p", 832)
    assert BuildConfig(source="vbvr:a", model="m", out="o").encoding.frames == 33


def test_missing_model_parts_are_named(tmp_path, tiny_model):
    broken = tmp_path / "model"
    shutil.copytree(tiny_model, broken)
    shutil.rmtree(broken / "text_encoder")
    src = make_shards(tmp_path / "src", {"s": [sample(0, 0, b"x", b"p")]})
    result = runner.invoke(app, _flags(src, broken, tmp_path / "out", "--frames", "17"))
    assert result.exit_code == 2 and "text_encoder/" in result.output


def test_make_tiny_model_loads_through_the_snapshot_path(tmp_path):
    target = tmp_path / "tiny"
    result = runner.invoke(app, ["make-tiny-model", str(target), "--seed", "3"])
    assert result.exit_code == 0, result.output
    index = json.loads((target / "model_index.json").read_text())
    assert index["vae"] == ["diffusers", "AutoencoderKLWan"] and index["text_encoder"][1] == "UMT5EncoderModel"
    assert not (target / "transformer").exists()
    vae_cfg = json.loads((target / "vae" / "config.json").read_text())
    assert (vae_cfg["z_dim"], vae_cfg["patch_size"], vae_cfg["scale_factor_spatial"]) == (48, 2, 16)
    assert vae_cfg["scale_factor_temporal"] == 4 and vae_cfg["is_residual"] is True
    assert tuple(vae_cfg["latents_mean"]) == WAN22_LATENTS_MEAN and tuple(vae_cfg["latents_std"]) == WAN22_LATENTS_STD
    family = resolve_family(target, None)  # detected, as for a real snapshot
    assert family.name == "wan22"
    encoder = load_family(target, family.name, torch.device("cpu"), torch.float32)
    pixels = torch.zeros(1, 3, FRAMES, HEIGHT, WIDTH)
    assert list(encoder.encode_video(pixels).shape) == [48, 5, HEIGHT // 16, WIDTH // 16]
    text = encoder.encode_text("a red ball rolls", TextSettings(max_length=512))
    assert text.embeds.shape == (512, 64) and 1 < text.seq_len < 512
    assert runner.invoke(app, ["make-tiny-model", str(target)]).exit_code == 2  # never over an existing model


def test_model_identity_follows_weights_not_location(tmp_path, tiny_model):
    family = resolve_family(tiny_model, "wan22")
    moved = tmp_path / "moved"
    shutil.copytree(tiny_model, moved)
    assert model_identity(moved, family) == model_identity(tiny_model, family)
    other = make_tiny_wan22(tmp_path / "other", seed=7)
    theirs = model_identity(other, family)
    mine = model_identity(tiny_model, family)
    assert theirs["vae"] != mine["vae"] and theirs["text_encoder"] != mine["text_encoder"]
    assert theirs["tokenizer"] == mine["tokenizer"]


def test_sanity_command_checks_one_sample_and_writes_nothing_into_out(tmp_path, tiny_model, clips):
    src = make_shards(
        tmp_path / "src",
        {"s": [sample(0, 0, b"not a video", b"broken first"), sample(1, 0, cut_clip(clips["carphone"], 9), b"ok")]},
    )
    out = tmp_path / "out"
    geometry = ["--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH), "--dtype", "fp32"]
    flags = ["--source", f"vbvr:{src}", "--model", str(tiny_model), "--out", str(out), "--device", "cpu", *geometry]
    result = runner.invoke(app, ["sanity", *flags])
    assert result.exit_code == 0, result.output
    assert f"[48, {(FRAMES - 1) // 4 + 1}, {HEIGHT // 16}, {WIDTH // 16}]" in result.output  # x0 of the usable one
    assert "disk" in result.output.lower() and not out.exists()
    unusable = make_shards(tmp_path / "bad", {"s": [sample(0, 0, b"x", b"p")]})
    bad = runner.invoke(app, ["sanity", "--source", f"vbvr:{unusable}", *flags[2:]])
    assert bad.exit_code == 1 and "no usable sample" in bad.output


@pytest.mark.parametrize("step", ["build", "sanity", "verify", "reconcile", "decode"])
def test_every_step_takes_the_options_of_its_settings_from_the_model(step):
    command = typer.main.get_command(app).commands[step]
    options = {opt for param in command.params for opt in param.opts}
    sections = {"upload": "--upload", "alerts": "--alert-webhook"}
    wanted = {sections.get(name, "--" + name.replace("_", "-")) for name in step_settings(step)}
    assert wanted <= options and "--config" in options
    help_text = {opt: param.help for param in command.params for opt in param.opts}
    for name, field in step_settings(step).items():
        flag = sections.get(name, "--" + name.replace("_", "-"))
        if name not in sections:
            assert help_text[flag].startswith(field.description or "")  # help taken from the model, not restated


def test_the_single_steps_take_the_builds_options(tmp_path, tiny_model, clips):
    src = make_shards(tmp_path / "src", {"s": [sample(0, 0, cut_clip(clips["carphone"], 9), b"a man talks")]})
    out = tmp_path / "out"
    spec = ["--format", "pt", "--text-padding", "raw", "--text-max-length", "512", "--frames", str(FRAMES)]
    spec += ["--height", str(HEIGHT), "--width", str(WIDTH), "--dtype", "fp32"]
    where = ["--source", f"vbvr:{src}", "--model", str(tiny_model)]
    sane = runner.invoke(app, ["sanity", *where, "--out", str(out), "--device", "cpu", *spec])
    assert sane.exit_code == 0, sane.output
    built = runner.invoke(app, ["build", *where, "--out", str(out), "--device", "cpu", *spec, "--decode-samples", "0"])
    assert built.exit_code == 0, built.output
    again = runner.invoke(app, ["sanity", *where, "--out", str(out), "--device", "cpu", *spec])  # a finished cache:
    assert again.exit_code == 0 and "_00000000" in again.output, again.output  # the step itself still encodes one
    assert "none to encode" not in again.output
    same = runner.invoke(app, ["verify", str(out), *spec])
    assert same.exit_code == 0 and "COMPATIBLE" in same.output, same.output
    other = runner.invoke(app, ["verify", str(out), *spec, "--text-padding", "zeros"])
    assert other.exit_code == 1 and "text_padding" in other.output
    counted = runner.invoke(app, ["reconcile", str(out), *spec, "--max-samples-per-shard", "1"])
    assert counted.exit_code == 0 and "OK (1 of 1" in counted.output, counted.output
    refused = runner.invoke(app, ["verify", str(out), "--text-padding", "nonsense"])
    assert refused.exit_code == 2 and "nonsense" in refused.output


def test_build_help_names_the_formats_and_where_the_text_cache_lives():
    from infra.config import FORMAT_NAMES  # noqa: PLC0415 - this test only
    from infra.formats import FORMATS  # noqa: PLC0415

    assert set(FORMAT_NAMES) == set(FORMATS.names())  # the help's list is the registry's
    shown = " ".join(runner.invoke(app, ["build", "--help"], terminal_width=400).output.split())
    assert "--format <str> Output format: " + ", ".join(FORMAT_NAMES) in shown
    assert "kept per shard task" in shown and "per process" not in shown  # as README and the code hold them


def test_a_model_folder_without_model_index_says_what_each_family_lacks(tmp_path, tiny_model):
    model = tmp_path / "model"
    shutil.copytree(tiny_model / "vae", model / "vae")  # a VAE alone: no model_index.json, no text encoder
    result = runner.invoke(app, _flags(tmp_path / "src", model, tmp_path / "out"))
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "no model_index.json" in text and "wan22 lacks text_encoder/, tokenizer/" in text
    assert "pass --family" not in text and not (tmp_path / "out").exists()
