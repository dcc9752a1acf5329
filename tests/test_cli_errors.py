"""The command line keeps its word on errors and help: every `--help` renders, exactly as written; a user's mistake
is one ``error: ...`` line and exit 2, found before any flow (or Prefect) starts; tracebacks only with --debug."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
import torch
import typer
from typer.testing import CliRunner

from flows.cli import app
from tests.conftest import make_shards, sample
from tests.procs import prefect_home

runner = CliRunner()
LF = str(Path(sys.executable).with_name("latentforge"))


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], click.Command]]:
    """Every command and subcommand, with the words that name it."""
    found = []
    for name, command in group.commands.items():
        found.append(((*prefix, name), command))
        if isinstance(command, click.Group):
            found += _commands(command, (*prefix, name))
    return found


COMMANDS = _commands(typer.main.get_command(app))


def _squeezed(text: str) -> str:
    return "".join(text.split())  # the help's wrapping (line breaks, indents) is the terminal's, not the text


@pytest.mark.parametrize("words", [words for words, _ in COMMANDS], ids=" ".join)
def test_every_help_renders_every_option_exactly(words):
    """`--help` of each command exits 0 and holds each option's help text as written: nothing eaten as markup
    (``[ray]``, ``[/path]``, ``[$PREFECT_HOME]``), no unset default shown."""
    command = dict(COMMANDS)[words]
    result = runner.invoke(app, [*words, "--help"])
    assert result.exit_code == 0, result.output
    rendered = _squeezed(result.output)
    for param in command.params:
        if isinstance(param, click.Option) and param.help and not param.hidden:
            assert _squeezed(param.help) in rendered, (param.name, param.help)
    assert "PydanticUndefined" not in result.output


@pytest.mark.parametrize(
    ("words", "text"),
    [
        (("build",), "needs pip install 'latentforge[ray]'"),
        (("build",), "padded ([max_length, D], as the recipe) or trimmed ([seq_len, D] plus seq_len"),
        (("upload",), "hf://datasets/ORG/NAME[@revision][/path] or s3://BUCKET/PREFIX"),
        (("server", "start"), "Prefect home (database, settings) [$PREFECT_HOME]"),
        (("server", "automations"), "[the recorded server's, else $PREFECT_API_URL]"),
    ],
)
def test_help_with_brackets_is_shown_as_written(words, text):
    result = runner.invoke(app, [*words, "--help"])
    assert result.exit_code == 0, result.output
    assert _squeezed(text) in _squeezed(result.output)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("errors") / "src", {"s1": [sample(0, 0, b"x", b"a prompt")]})


def _build(src: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return ["build", "--source", f"vbvr:{src}", "--model", str(model), "--out", str(out), "--device", "cpu", *extra]


CASES = {
    "unknown source kind": (lambda src, tmp: ["--source", f"vbrv:{src}"], "unknown source kind 'vbrv'"),
    "source path missing": (lambda src, tmp: ["--source", f"vbvr:{tmp / 'nowhere'}"], "no such file or directory"),
    "meta on a directory": (lambda src, tmp: ["--source", f"meta:{src}"], "meta source"),
    "shard filter matches nothing": (lambda src, tmp: ["--shard-filter", "zzz"], "--shard-filter 'zzz' matches none"),
    "out is a file": (lambda src, tmp: ["--out", str(tmp / "a-file")], "is a file, not a directory"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("step", ["build", "sanity"])
def test_usage_errors_are_one_line_and_exit_2_before_anything_runs(tmp_path, src, tiny_model, case, step):
    extra, named = CASES[case]
    (tmp_path / "a-file").write_text("not a cache")
    args = _build(src, tiny_model, tmp_path / "out", "--frames", "9", "--height", "48", "--width", "48")
    args[0] = step
    result = runner.invoke(app, [*args, *extra(src, tmp_path)])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [result.stderr.strip()] and result.stderr.startswith("error: ")
    assert named in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.sanity").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")
def test_a_named_device_that_is_not_there_is_a_usage_error(tmp_path, src, tiny_model):
    args = _build(src, tiny_model, tmp_path / "out", "--frames", "9", "--height", "48", "--width", "48")
    args[args.index("--device") + 1] = "cuda"
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and result.stderr.strip() == "error: --device cuda: no CUDA device is visible to torch"
    assert not (tmp_path / "out").exists()


def test_a_usage_error_from_the_terminal_is_one_line_and_a_traceback_only_with_debug(tmp_path, src, tiny_model):
    """The console script: nothing but the one line (no Prefect output: it never started); --debug and
    LATENTFORGE_DEBUG=1 add the traceback."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    args = _build(src, tiny_model, tmp_path / "out", "--source", f"vbrv:{src}")
    quiet = subprocess.run([LF, *args], env=env, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 2
    assert quiet.stdout == "" and quiet.stderr.splitlines() == [
        "error: unknown source kind 'vbrv'; known source kinds: folder, meta, vbvr, wds"
    ]
    loud = subprocess.run([LF, "--debug", *args], env=env, capture_output=True, text=True, timeout=120)
    assert loud.returncode == 2 and "Traceback" in loud.stderr and loud.stderr.rstrip().endswith(quiet.stderr.strip())
    by_env = subprocess.run(
        [LF, *args], env={**env, "LATENTFORGE_DEBUG": "1"}, capture_output=True, text=True, timeout=120
    )
    assert by_env.returncode == 2 and "Traceback" in by_env.stderr


def test_a_missing_source_is_one_line(tmp_path, tiny_model):
    result = runner.invoke(app, ["build", "--model", str(tiny_model), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and result.stderr.strip() == "error: invalid configuration: source: Field required"


def test_a_bug_is_one_line_too_with_the_traceback_under_debug(tmp_path, monkeypatch):
    """An error latentforge did not expect (here: a cache whose cache.json is a list) is one line, exit 1, and
    says how to see the traceback."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "cache.json").write_text("[1, 2]")
    monkeypatch.delenv("LATENTFORGE_DEBUG", raising=False)
    result = runner.invoke(app, ["audio-check", str(out)])
    assert result.exit_code in (1, 2) and len(result.stderr.splitlines()) == 1, result.output
    assert result.stderr.startswith("error: ") and "Traceback" not in result.output


@pytest.mark.parametrize("where", ["nowhere", "a-file", "empty"])
def test_upload_of_what_is_not_a_cache_is_a_usage_error(tmp_path, where):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty").mkdir()
    result = runner.invoke(app, ["upload", str(tmp_path / where), "--to", "s3://bucket/prefix"])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"error: {tmp_path / where} is not a latentforge cache: "
        + {"nowhere": "it does not exist", "a-file": "it is not a directory", "empty": "it has no cache.json"}[where]
    ]


def test_a_finding_inside_the_flow_ends_in_one_error_line_and_its_traceback_only_with_debug(
    tmp_path, tiny_model, clips
):
    """A loss found by reconciliation (one corrupt clip, --on-loss abort) fails the flow inside Prefect: the terminal
    shows Prefect's one-line failure and the `error:` line, exit 1, and the traceback only with LATENTFORGE_DEBUG=1
    (a bug's traceback is always shown: the formatter hides only latentforge's own errors)."""
    src = make_shards(
        tmp_path / "src", {"s1": [sample(0, 0, clips["bikes"], b"a prompt"), sample(1, 0, b"not a video", b"p")]}
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "LATENTFORGE_DEBUG")}
    geometry = ("--frames", "9", "--height", "48", "--width", "48", "--dtype", "fp32", "--decode-samples", "0")
    codes = {}
    with contextlib.ExitStack() as stack:
        for name, extra_env in (("quiet", {}), ("debug", {"LATENTFORGE_DEBUG": "1"})):
            # the two runs side by side (each its own OUT and Prefect home): they share nothing, and take half as long
            home = {"PREFECT_HOME": str(prefect_home(tmp_path / f"prefect-{name}"))}
            args = _build(src, tiny_model, tmp_path / f"out-{name}", *geometry, "--on-loss", "abort")
            stderr = stack.enter_context((tmp_path / f"{name}.stderr").open("w"))
            codes[name] = subprocess.Popen(
                [LF, *args], env={**env, **home, **extra_env}, stdout=subprocess.DEVNULL, stderr=stderr
            )
        codes = {name: build.wait(timeout=600) for name, build in codes.items()}
    quiet_stderr, debug_stderr = ((tmp_path / f"{name}.stderr").read_text() for name in ("quiet", "debug"))
    assert codes == {"quiet": 1, "debug": 1}, quiet_stderr[-2000:]
    lines = quiet_stderr.strip().splitlines()
    (error,) = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert "video_decode_error" in lines[error] and "--on-loss accept" in lines[error], lines[error:]
    assert lines[error + 1 :] == ["decided: abort by the setting on_loss=abort"]  # its detail, after it
    assert "Traceback" not in quiet_stderr
    assert "Traceback" in debug_stderr and "LossAborted" in debug_stderr
