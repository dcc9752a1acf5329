"""What a user reads, through the CLI: one folder source (nested groups, a top-level file, a one-frame clip) built
and then read by summary, inspect, verify and reconcile, which must print every sample and group name one way, in
the flags' words; its resume after a file left the source and another came; and an LTX-2 cache built with two
buckets, whose inspect and summary show both geometries with the format's own output keys."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tests.conftest import FRAMES, HEIGHT, WIDTH
from tests.media_utils import cut_clip

runner = CliRunner()
NAMES = {"film/Megamind.mp4": "a man talks", "videos/bikes.mp4": "bikes", "tree.mp4": "a tree"}
STILL = "videos/still.mp4"  # one frame: repeated to fill the geometry's frames under span
BUCKETS = "64x64x9;64x64x1"  # W×H×F: the clips go to the first, the still to the second


def _folder(root: Path, clips: dict[str, bytes]) -> Path:
    video = cut_clip(clips["carphone"], FRAMES, width=96)
    for name, caption in {**NAMES, STILL: "one frame"}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(cut_clip(clips["bikes"], 1, width=96) if name == STILL else video)
        path.with_suffix(".txt").write_text(caption)
    return root


def _run(*args: str) -> str:
    result = runner.invoke(app, [*args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, clips: dict[str, bytes]) -> dict[str, str]:
    """The build's output (sanity and summary), then inspect, verify and reconcile of its cache."""
    root = tmp_path_factory.mktemp("names")
    src, out = _folder(root / "src", clips), root / "out"
    geometry = ["--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH)]
    where = ["--source", f"folder:{src}", "--model", str(tiny_model), "--out", str(out)]
    build = _run("build", *where, *geometry, "--device", "cpu", "--decode-samples", "0")
    outputs = {
        "build": build,
        "inspect": _run("inspect", str(out)),
        "verify": _run("verify", str(out)),
        "reconcile": _run("reconcile", str(out)),
    }
    for gone in ("tree.mp4", "tree.txt"):  # a file leaves the source, another comes: the same command resumes
        (src / gone).unlink()
    (src / "videos/new.mp4").write_bytes((src / "videos/bikes.mp4").read_bytes())
    (src / "videos/new.txt").write_text("bikes again")
    outputs["resume"] = _run("build", *where, *geometry, "--device", "cpu", "--decode-samples", "0")
    return outputs


def test_names_and_words_are_printed_one_way_by_every_command(outputs: dict[str, str]) -> None:
    for command, text in outputs.items():
        assert "film/film/" not in text and "videos/videos/" not in text, command  # a group never doubled
        assert not re.search(r"(^|[\s|])/tree\.mp4", text, re.MULTILINE), command  # a top-level file: no "/"
        assert "\u200b" not in text, command  # nothing invisible in a path a person copies
        assert "linspace" not in text and "bilinear-align_corners" not in text, command  # the flags' words
    for command in ("inspect", "verify", "reconcile"):  # the empty group, one way
        assert "(no group)" in outputs[command], outputs[command]
    assert "temporal: span" in outputs["verify"] and "resize: stretch" in outputs["verify"]
    assert "temporal span" in outputs["inspect"] and "resize stretch" in outputs["inspect"]
    assert "sample               film/Megamind.mp4" in outputs["build"]  # the sanity's sample
    assert re.search(r"^frames\s+1 sample\(s\) had fewer frames", outputs["build"], re.MULTILINE), outputs["build"]
    assert "1 with frames repeated" in outputs["inspect"]


def test_a_resume_counts_the_source_as_it_is_and_projects_what_is_left(outputs: dict[str, str]) -> None:
    resume = outputs["resume"]
    assert "samples     5: 5 done (1 encoded now, 3 reused)" in resume, resume
    assert "4 in the source now; 1 gone from it since encoded, kept in the cache" in resume
    assert "projected            1 samples left to encode (of 4; the others are done)" in resume


def test_a_bucketed_cache_shows_every_geometry_with_the_formats_keys(
    tmp_path: Path, ltx2_model: Path, clips: dict[str, bytes]
) -> None:
    src, out = _folder(tmp_path / "src", clips), tmp_path / "out"
    for name in ("film/Megamind.mp4", "tree.mp4"):  # two samples are enough: one per bucket
        (src / name).unlink()
    where = ["--source", f"folder:{src}", "--model", str(ltx2_model), "--out", str(out)]
    flags = ["--recipe", "ltx2-trainer", "--buckets", BUCKETS, "--skip-audio", "--device", "cpu"]
    build = _run("build", *where, *flags, "--decode-samples", "0")
    report = json.loads(_run("inspect", str(out), "--json"))
    shown = {(g["frames"], g["height"], g["width"]): g for g in report["geometry"]}
    assert set(shown) == {(9, 64, 64), (1, 64, 64)} and report["buckets"] == BUCKETS.split(";")
    assert [shown[k]["samples"] for k in ((9, 64, 64), (1, 64, 64))] == [1, 1]
    assert shown[(9, 64, 64)]["outputs"]["latents"]["shape"] == [128, 2, 2, 2]
    assert shown[(1, 64, 64)]["outputs"]["latents"]["shape"] == [128, 1, 2, 2]
    assert all("video_prompt_embeds" in g["outputs"] for g in shown.values())
    text = _run("inspect", str(out))
    for lines in (text, build):  # inspect and the build summary: both geometries, the format's key names
        assert "F×H×W 9×64×64: 1 sample(s); latents [128, 2, 2, 2] bfloat16" in lines, lines
        assert "F×H×W 1×64×64: 1 sample(s); latents [128, 1, 2, 2] bfloat16" in lines, lines
        assert "video_prompt_embeds [1024, 64] bfloat16" in lines
    assert re.search(r"^video_prompt_embeds\s+\[1024, 64\]", build, re.MULTILINE)  # the sanity's rows too
    assert "x0" not in build and "text_embeds [" not in build  # no Wan key names for an LTX-2 cache
