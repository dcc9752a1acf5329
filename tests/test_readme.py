"""The README's commands are run as written: every code block the README (or a page of docs/) marks with
``<!-- test: ... -->`` runs,
command by command, in a temporary directory (``/tmp/`` in a command stands for it), and each command's exit code
and one line of its output are checked against the marker. The marker holds one ``EXIT "text"`` per command, in
order, separated by ``;``. A marked block holds only ``latentforge`` commands (comments and line continuations
allowed), so the README cannot drift from the code."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app

ROOT = Path(__file__).resolve().parents[1]
#: The pages whose marked blocks run: the README and the user pages under docs/.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- test: (?P<expect>[^\n]*) -->\n```bash\n(?P<code>.*?)\n```", re.DOTALL | re.MULTILINE)
EXPECT = re.compile(r'\s*(?P<code>\d+)\s+"(?P<text>[^"]*)"\s*')
PROGRAMS = ("latentforge", ".venv/bin/latentforge")


@dataclass(frozen=True)
class Step:
    """One README command and what it must do."""

    line: str  # page:line
    args: list[str]
    exit_code: int
    text: str


def _commands(code: str) -> list[str]:
    """The block's commands: continuations joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]  # type: ignore[misc]


def readme_blocks(text: str, name: str = "README.md") -> list[list[Step]]:
    """Every marked block of `text` (the page `name`), as its steps; ValueError for a marker that does not fit its
    block."""
    blocks = []
    for match in MARKER.finditer(text):
        line = text[: match.start()].count("\n") + 1
        expectations = [EXPECT.fullmatch(part) for part in match["expect"].split(";")]
        commands = [c for c in _commands(match["code"]) if c]
        if None in expectations or len(expectations) != len(commands):
            raise ValueError(f"{name}:{line}: {len(commands)} command(s), marker {match['expect']!r}")
        steps = []
        for words, expected in zip(commands, expectations, strict=True):
            if words[0] not in PROGRAMS:
                raise ValueError(f"{name}:{line}: a marked block runs latentforge only, not {words[0]!r}")
            steps.append(Step(f"{name}:{line}", words[1:], int(expected["code"]), expected["text"]))  # type: ignore[index]
        blocks.append(steps)
    return blocks


BLOCKS = [
    block for page in PAGES for block in readme_blocks(page.read_text(encoding="utf-8"), str(page.relative_to(ROOT)))
]


def test_the_readme_marks_its_runnable_blocks():
    """The marked blocks are there (the README's walk-through, the image family's tiny model in docs/), each whole."""
    assert len(BLOCKS) >= 2 and sum(len(b) for b in BLOCKS) >= 10
    assert {block[0].line.partition(":")[0] for block in BLOCKS} >= {"README.md", "docs/images.md"}
    assert any(step.args[:1] == ["build"] for block in BLOCKS for step in block)
    with pytest.raises(ValueError, match="1 command"):
        readme_blocks('<!-- test: 0 "a"; 0 "b" -->\n```bash\nlatentforge recipes\n```')
    with pytest.raises(ValueError, match="latentforge only"):
        readme_blocks('<!-- test: 0 "a" -->\n```bash\nrm -rf demo\n```')


@pytest.mark.parametrize("block", BLOCKS, ids=[b[0].line for b in BLOCKS])
def test_readme_block_runs_as_written(block, tmp_path, monkeypatch, clips):
    """Each command of the block, in order, in a fresh directory: its exit code and a line of its output."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    for step in block:
        args = [re.sub(r"^/tmp/", f"{tmp_path}/", arg) for arg in step.args]
        result = runner.invoke(app, args)
        shown = f"{step.line}: latentforge {shlex.join(step.args)}\n{result.output}"
        assert result.exception is None or isinstance(result.exception, SystemExit), shown
        assert result.exit_code == step.exit_code, shown
        assert step.text in result.stdout, shown
