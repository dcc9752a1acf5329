"""Named recipes (resolved settings, overrides, the fingerprint of the settings not the name, `recipes`,
`inspect`) and the overfit export (copies under distinct ids, lossless reference clips, the prompts file, OUT
untouched, the export a cache of its own)."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.audit.inspect import inspect_cache
from infra.config import BuildConfig, CacheSpec
from infra.formats import get_format
from infra.gates.verify import verify_out
from infra.media.resize import RESIZE_POLICIES
from infra.plan import make_spec
from infra.preprocess.prepare import prepare_video
from infra.recipes import RECIPES, apply_recipe
from tests.conftest import config, make_shards, sample, tree_hashes

runner = CliRunner()
CALL = "G-11_handle_object_reappearance_data-generator/handle_object_reappearance_00000000"


def test_a_recipe_resolves_to_its_settings_and_the_fingerprint_is_of_the_settings(tmp_path, tiny_model):
    src = tmp_path / "src"
    named = config(src, tiny_model, tmp_path / "o", recipe="wan22-vbvr", frames=5, height=32, width=32)
    spelled = config(src, tiny_model, tmp_path / "o", frames=5, height=32, width=32, temporal="span", resize="stretch")
    _, spec, _, _ = make_spec(named)
    assert (spec.temporal, spec.resize, spec.text_padding, spec.text_max_length) == (
        "linspace",
        RESIZE_POLICIES["stretch"],
        "raw",
        512,
    )
    assert (spec.frames, spec.height, spec.width) == (5, 32, 32)  # flags win over the recipe's 33x832x832
    assert spec.fingerprint() == make_spec(spelled)[1].fingerprint()
    bare = apply_recipe(
        BuildConfig(source=f"vbvr:{src}", model=str(tiny_model), out=str(tmp_path / "o"), recipe="wan22-vbvr")
    )
    assert (bare.encoding.frames, bare.encoding.height, bare.encoding.width, bare.family) == (33, 832, 832, "wan22")


def test_a_recipe_fills_only_what_was_not_given_and_applies_once():
    given = BuildConfig(source="vbvr:/x", model="/m", out="/o", recipe="image-512", frames=33)  # 33: also the default
    applied = apply_recipe(given)
    assert (applied.family, applied.encoding.frames, applied.encoding.height, applied.encoding.resize) == (
        "image",
        33,
        512,
        "torchvision",
    )
    assert apply_recipe(applied) == applied and apply_recipe(applied.with_values(recipe=None)) == applied.with_values(
        recipe=None
    )


def test_ltx2_recipes_and_their_overrides(tmp_path, ltx2_model):
    src = tmp_path / "src"
    _, spec, _, _ = make_spec(
        config(src, ltx2_model, tmp_path / "o", recipe="ltx2-trainer", frames=9, height=64, width=64)
    )
    assert (spec.family, spec.format, spec.temporal, spec.text_stage, spec.text_max_length) == (
        "ltx2",
        "ltx",
        "head",
        "pre_connector",
        1024,
    )
    assert spec.resize == RESIZE_POLICIES["cover-crop"]
    over = config(
        src, ltx2_model, tmp_path / "o", recipe="ltx2-trainer", resize="cover-crop-aa", frames=9, height=64, width=64
    )
    assert make_spec(over)[1].resize == RESIZE_POLICIES["cover-crop-aa"]
    fastvideo = make_spec(
        config(src, ltx2_model, tmp_path / "o", recipe="fastvideo-ltx2", frames=9, height=64, width=64)
    )
    assert (fastvideo[1].format, fastvideo[1].parquet_dtype, fastvideo[1].temporal) == ("parquet", "fp32", "fps:24")
    with pytest.raises(ValueError, match="unknown recipe 'nope'"):
        make_spec(config(src, ltx2_model, tmp_path / "o", recipe="nope"))


def test_recipes_lists_every_recipe_with_every_setting():
    text = runner.invoke(app, ["recipes"])
    assert text.exit_code == 0
    for recipe in RECIPES.values():
        block = text.output.split(recipe.name + "\n", 1)[1]
        assert all(f"--{key.replace('_', '-')}" in block for key in recipe.settings), recipe.name
    listed = json.loads(runner.invoke(app, ["recipes", "--json"]).output)
    assert set(listed) >= {"wan22-vbvr", "ltx2-trainer", "fastvideo-ltx2", "wan22-context", "image-512"}
    assert listed["wan22-context"]["temporal"] == "windows:2" and listed["wan22-context"]["frames"] == 29


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory, tiny_model, clips) -> Path:
    """Three samples in two groups, made with the wan22-vbvr recipe at a small geometry."""
    root = tmp_path_factory.mktemp("overfit")
    src = make_shards(
        root / "src",
        {
            "G-11_part-00000": [sample(0, 0, clips["carphone"], b"a call"), sample(0, 1, clips["bikes"], b"bikes")],
            "O-21_part-00000": [sample(1, 0, clips["bigbuckbunny"], b"a rabbit")],
        },
    )
    ok, result = run_build(config(src, tiny_model, root / "out", recipe="wan22-vbvr", frames=9, height=48, width=80))
    assert ok and result["done"] == 3
    return root / "out"


def test_inspect_shows_the_recipe(cache):
    report = inspect_cache(cache)
    assert report["recipe"] == "wan22-vbvr" and report["temporal"] == "span"  # the flag's name, not the stored one
    assert "recipe       wan22-vbvr" in runner.invoke(app, ["inspect", str(cache)]).output


def test_overfit_export_copies_references_prompts_and_leaves_out_alone(cache, tmp_path, clips):
    before = tree_hashes(cache)
    to = tmp_path / "overfit"
    result = runner.invoke(app, ["overfit", str(cache), "--ids", CALL, "--copies", "3", "--to", str(to)])
    assert result.exit_code == 0, result.output
    assert tree_hashes(cache) == before and not any(p.name.startswith(".overfit") for p in tmp_path.iterdir())
    fmt, spec = get_format("pt"), CacheSpec.model_validate(json.loads((cache / "cache.json").read_text())["spec"])
    original = fmt.read(cache / f"{CALL}.pt")
    copies = sorted((to / CALL).parent.glob("*.pt"))
    assert [p.name for p in copies] == [f"handle_object_reappearance_00000000-c00{i}.pt" for i in range(3)]
    for i, path in enumerate(copies):
        record = fmt.read(path)
        assert record["id"] == f"handle_object_reappearance_00000000-c00{i}"
        assert torch.equal(record["x0"], original["x0"]) and torch.equal(record["text_embeds"], original["text_embeds"])
    assert json.loads((to / "validation_prompts.json").read_text()) == {"data": [{"caption": "a call"}]}
    with av.open(str(to / "reference" / f"{CALL}.mp4")) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    pixels = prepare_video(clips["carphone"], spec).pixels[0]
    exact = ((pixels + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()
    assert frames.shape == (9, 48, 80, 3) and np.array_equal(frames, exact)  # lossless: the recipe's pixels
    shapes = {k: tuple(v.shape) for k, v in (("latents", original["x0"]), ("text", original["text_embeds"]))}
    report = verify_out(to, spec, latent_shape=shapes["latents"], text_shape=shapes["text"])
    assert report.kind == "compatible" and report.done == 3 and not report.problems and not report.missing


def test_overfit_by_count_and_refusals(cache, tmp_path):
    to = tmp_path / "two"
    assert runner.invoke(app, ["overfit", str(cache), "--n", "2", "--to", str(to)]).exit_code == 0
    groups = sorted(p.name for p in to.iterdir() if p.is_dir() and p.name not in ("ledger", "reference"))
    assert len(groups) == 2 and len(json.loads((to / "validation_prompts.json").read_text())["data"]) == 2
    inside = runner.invoke(app, ["overfit", str(cache), "--n", "1", "--to", str(cache / "sub")])
    assert inside.exit_code == 2 and "never writes into OUT" in inside.output and not (cache / "sub").exists()
    unknown = runner.invoke(app, ["overfit", str(cache), "--ids", "nope", "--to", str(tmp_path / "x")])
    assert unknown.exit_code == 2 and "no done sample nope" in unknown.output and not (tmp_path / "x").exists()
    again = runner.invoke(app, ["overfit", str(cache), "--n", "1", "--to", str(to)])
    assert again.exit_code == 2 and "non-empty" in again.output
