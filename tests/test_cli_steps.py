"""The standalone steps on an existing OUT keep the build's word: the recipe the user names outranks OUT's own
cache.json (as in `build`), the build's selection is read back with the cache, and `decode` builds its config as
every other command does (validated; ``--n`` still accepted, with a warning)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tests.conftest import FRAMES, HEIGHT, WIDTH, make_shards, sample
from tests.media_utils import cut_clip

runner = CliRunner()
GEOMETRY = ["--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH)]


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_model, clips) -> tuple[Path, Path, Path]:
    """`build --config cfg.yaml --limit 2` where the file sets ``shard_filter`` and ``text_padding: zeros``: two
    shards of three clips, one kept, two of its samples built. Returns (source, OUT, the config file)."""
    root = tmp_path_factory.mktemp("steps")
    video = cut_clip(clips["carphone"], 9)
    src = make_shards(
        root / "src",
        {
            "keep-a": [sample(0, i, video, f"clip {i}".encode()) for i in range(3)],
            "other-b": [sample(1, i, video, f"clip {i}".encode()) for i in range(3)],
        },
    )
    cfg = root / "cfg.yaml"
    cfg.write_text(
        f"source: vbvr:{src}\nmodel: {tiny_model}\ndevice: cpu\ndtype: fp32\nshard_filter: keep\n"
        "text_padding: zeros\ndecode_samples: 0\non_loss: abort\n"
    )
    out = root / "out"
    result = runner.invoke(app, ["build", "--config", str(cfg), "--out", str(out), "--limit", "2", *GEOMETRY])
    assert result.exit_code == 0, result.output
    assert "2 done" in result.output
    return src, out, cfg


def test_reconcile_uses_the_builds_selection(built):
    """Issue 33 item 5: the limit and the file's shard filter are read back with the cache: OK, not a shortfall."""
    _, out, _ = built
    same = runner.invoke(app, ["reconcile", str(out)])
    assert same.exit_code == 0, same.output
    assert "OK (2 of 2 expected samples produced)" in same.stdout and same.stderr == ""
    wider = runner.invoke(app, ["reconcile", str(out), "--limit", "3"])
    assert wider.exit_code == 1 and "SHORTFALL 1 (2 of 3" in wider.stdout, wider.output
    assert "note: the build selected --limit 2" in wider.stderr and "this step uses 3, as given" in wider.stderr


def test_verify_takes_the_builds_selection_and_says_when_it_is_given_another(built, tmp_path):
    _, out, _ = built
    other = tmp_path / "other.yaml"
    other.write_text("shard_filter: other\n")
    result = runner.invoke(app, ["verify", str(out), "--config", str(other)])
    assert result.exit_code == 0 and "COMPATIBLE" in result.stdout, result.output
    assert "the build selected --shard-filter keep" in result.stderr


def test_verify_with_a_recipe_agrees_with_build_dry_run(built, tiny_model):
    """Issue 33 item 3: `--recipe wan22-vbvr` sets text_padding raw, the cache holds zeros: both `verify` and
    `build --dry-run` say incompatible (the recipe named outranks OUT's own cache.json, flags outrank both)."""
    src, out, _ = built
    recipe = ["--recipe", "wan22-vbvr", *GEOMETRY]
    verified = runner.invoke(app, ["verify", str(out), *recipe])
    assert verified.exit_code == 1, verified.output
    assert "INCOMPATIBLE" in verified.stdout and "text_padding" in verified.stdout
    dry = runner.invoke(
        app, ["build", "--source", f"vbvr:{src}", "--model", str(tiny_model), "--out", str(out), "--device", "cpu",
              "--dtype", "fp32", *recipe, "--dry-run"]
    )  # fmt: skip
    assert dry.exit_code == 0, dry.output
    assert f"{out}: incompatible" in dry.stdout
    kept = runner.invoke(app, ["verify", str(out), *recipe, "--text-padding", "zeros"])
    assert kept.exit_code == 0 and "COMPATIBLE" in kept.stdout, kept.output


def test_decode_validates_its_config_and_keeps_n_as_a_deprecated_alias(built, tmp_path):
    """Issue 28: decode builds its config as every command does (an unknown key in the file is refused), and
    ``--n K`` still works for one release, with a warning."""
    _, out, _ = built
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode_samplez: 1\n")
    refused = runner.invoke(app, ["decode", str(out), "--config", str(bad)])
    assert refused.exit_code == 2 and "decode_samplez" in refused.stderr, refused.output
    old = runner.invoke(app, ["decode", str(out), "--n", "1"])
    assert old.exit_code == 0, old.output
    assert "--n is deprecated" in old.stderr and "use --decode-samples" in old.stderr
    assert "decode-verify: REPORTED (1 sample(s)" in old.stdout, old.stdout
    folder = next(line.split("files ", 1)[1] for line in old.stdout.splitlines() if "files " in line).strip()
    assert len(json.loads((Path(folder) / "report.json").read_text())["rows"]) == 1
