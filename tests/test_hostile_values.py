"""Hostile config values: every value a flag, a config file or a recipe can carry is checked for its type and its
bound before anything is allocated, and a bad one is one ``error: ...`` line naming the setting, the value, the
bound and the flag, exit 2, no traceback, also with ``--dry-run``.

The issue's attacks each have their test (``--frames 1000000001`` and ``--text-max-length 2000000000`` went out of
memory even with --dry-run, ``--height 1600000`` asked the allocator for 522 TB, a config file that is not UTF-8
ended in a UnicodeDecodeError); generated values (hypothesis) of every setting, through a flag or a config file,
run up to the source's listing (a shard filter that keeps nothing stops each run there, before any flow).
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from flows.cli import app
from infra import bounds
from infra.config import BuildConfig, load_config_file
from infra.errors import ConfigError

runner = CliRunner()
STOP = "no-such-shard"  # the shard filter that ends a run whose values all pass, before any flow starts


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("values")
    (folder / "a.mp4").write_bytes(b"never read here")
    (folder / "d.jsonl").write_text(json.dumps({"video": "a.mp4", "caption": "x"}) + "\n")
    return folder / "d.jsonl"


def _build(src: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return ["build", "--source", f"meta:{src}", "--model", str(model), "--out", str(out), "--device", "cpu", *extra]


def _one_error_line(result, out: Path) -> str:
    """The run ended with exactly one ``error:`` line, exit 2, no traceback, OUT untouched; that line."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert "Traceback" not in result.output and not out.exists()
    return result.stderr.strip()


ATTACKS = {
    "frames": ("1000000001", f"{bounds.MAX_FRAMES}"),
    "text_max_length": ("2000000000", f"{bounds.MAX_TEXT_TOKENS}"),
    "height": ("1600000", f"{bounds.MAX_SIDE}"),
}


@pytest.mark.parametrize("name", list(ATTACKS))
@pytest.mark.parametrize("given_as", ["flag", "config file"])
def test_an_absurd_size_is_one_line_before_anything_is_allocated(tmp_path, src, tiny_model, name, given_as):
    """Before: --frames 1000000001 and --text-max-length 2000000000 went out of memory in a --dry-run, --height
    1600000 asked for 522 TB. Now: the setting, its value, its flag and the bound, in one line, exit 2."""
    value, bound = ATTACKS[name]
    flag = "--" + name.replace("_", "-")
    extra = [flag, value] if given_as == "flag" else ["--config", str(tmp_path / "c.yaml")]
    (tmp_path / "c.yaml").write_text(f"{name}: {value}\n")
    result = runner.invoke(app, _build(src, tiny_model, tmp_path / "out", *extra, "--dry-run"))
    line = _one_error_line(result, tmp_path / "out")
    assert f"{name} = {value} ({flag})" in line and f"less than or equal to {bound}" in line, line
    assert "sanity bound" in line


def test_a_geometry_too_big_for_one_vae_call_names_its_product(tmp_path, src, tiny_model):
    """Each side within its bound, the product not: 2 × 257 frames of 4K are 4.3 × 10^9 pixels in one call."""
    extra = ("--frames", "257", "--height", "2160", "--width", "3840", "--video-batch", "2", "--dry-run")
    line = _one_error_line(runner.invoke(app, _build(src, tiny_model, tmp_path / "out", *extra)), tmp_path / "out")
    assert "2 × 257 × 2160 × 3840 = 4,263,321,600 pixels per VAE call" in line and "2,147,483,648" in line


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (b"frames: 33\ncaption_column: caf\xe9\n", "not UTF-8 text (byte 0xe9 at offset 30)"),
        (b"frames: [33\n  x: {", "not YAML or JSON at line 2, column 4"),
        (b"[" * 1_000, "nested too deeply"),
        (b"- frames\n", "must be a mapping"),
        (b'{"frames": 33, "height": 32', "not YAML or JSON at line 1"),
    ],
)
def test_a_config_file_that_is_not_utf8_or_not_parseable_is_one_line(tmp_path, src, tiny_model, data, said):
    """Before: a config that was not UTF-8 ended in ``UnicodeDecodeError`` (exit 1, a bug's line), a YAML error in a
    message of four lines, exit 1."""
    (tmp_path / "c.yaml").write_bytes(data)
    extra = ("--config", str(tmp_path / "c.yaml"), "--dry-run")
    line = _one_error_line(runner.invoke(app, _build(src, tiny_model, tmp_path / "out", *extra)), tmp_path / "out")
    assert said in line and str(tmp_path / "c.yaml") in line, line
    with pytest.raises(ConfigError, match=said.split(" (")[0]):
        load_config_file(tmp_path / "c.yaml")


def test_a_flag_of_the_wrong_type_is_one_line(tmp_path, src, tiny_model):
    """The parser's own usage errors too (they were four lines: usage, a hint, a blank, ``Error: ...``)."""
    for extra in (("--frames", "abc"), ("--dtype", "fp64"), ("--no-such-flag",)):
        line = _one_error_line(runner.invoke(app, _build(src, tiny_model, tmp_path / "out", *extra)), tmp_path / "out")
        assert extra[0] in line, line


#: Every setting a build takes, but those that name the run's own files and the shard filter that stops it.
SETTINGS_NAMES = sorted(set(BuildConfig.settings()) - {"source", "model", "out", "shard_filter"})
TEXT = st.text(st.sampled_from("ab0 ,;:x.-\0\udcff\ud800é\n"), max_size=12)
VALUES = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80),
    st.integers(min_value=-3, max_value=2**33),
    st.floats(),
    TEXT,
    st.booleans(),
    st.none(),
    st.lists(st.one_of(st.integers(), TEXT), max_size=3),
    st.dictionaries(st.sampled_from(["to", "x"]), TEXT, max_size=2),
    st.just("7" * 100_000),
)


def _bounded_int(name: str) -> int | None:
    """The upper bound of an integer setting (None: not an integer setting, or no bound)."""
    field = BuildConfig.settings()[name]
    return next((m.le for m in field.metadata if getattr(m, "le", None) is not None), None)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(SETTINGS_NAMES), value=VALUES, as_flag=st.booleans())
@example(name="frames", value=1_000_000_001, as_flag=False)
@example(name="width", value=2**80, as_flag=True)
@example(name="min_psnr", value=math.nan, as_flag=False)
@example(name="lora_trigger", value="a\0b", as_flag=False)
@example(name="temporal", value="fps:" + "9" * 400, as_flag=True)
def test_any_value_of_any_setting_is_accepted_or_one_line(src, tiny_model, name, value, as_flag):
    """A generated value of a generated setting, through its flag or a config file: the command ends exit 2 with
    exactly one ``error:`` line (the value's, or the stopping shard filter's once every value passes) and no
    traceback; an integer over its bound is named with the setting."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        if as_flag:
            shown = json.dumps(value) if isinstance(value, list | dict) else str(value)
            extra = ["--" + name.replace("_", "-"), shown]
        else:
            (Path(tmp) / "c.json").write_text(json.dumps({name: value}))
            extra = ["--config", str(Path(tmp) / "c.json")]
        result = runner.invoke(app, _build(src, tiny_model, out, "--shard-filter", STOP, *extra))
        line = _one_error_line(result, out)
        bound = _bounded_int(name)
        if bound is not None and isinstance(value, int) and not isinstance(value, bool) and value > bound:
            assert name in line, line
