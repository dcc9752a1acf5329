"""OUT apart from the source (issue 56, item 1): `--out` equal to the source's folder, inside it, or holding it is
refused before anything runs — one ``error:`` line naming both, exit 2, nothing written — local or in a store."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from infra.errors import EXIT_USAGE
from tests.conftest import make_shards, sample


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return make_shards(tmp_path / "clips", {"part": [sample(0, 0, b"not read", b"a prompt")]})


def _listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}


@pytest.mark.parametrize(
    ("source_arg", "out_arg", "how"),
    [
        ("{src}", "{src}", "is"),
        ("{src}", "{src}/cache", "is inside"),
        ("{src}/part.tar", "{src}", "holds"),
        ("{src}/*.tar", "{src}/sub/cache", "is inside"),
        ("{src}", "{src}/..", "holds"),
    ],
    ids=["same", "inside", "holds-the-file", "inside-a-pattern", "parent"],
)
def test_an_out_that_overlaps_the_source_is_refused_up_front(source, tiny_model, source_arg, out_arg, how):
    before = _listing(source.parent)
    src, out = source_arg.format(src=source), out_arg.format(src=source)
    result = CliRunner().invoke(
        app, ["build", "--source", f"vbvr:{src}", "--model", str(tiny_model), "--out", out, "--device", "cpu"]
    )
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == EXIT_USAGE, result.output
    assert len(errors) == 1 and f"--out {out} {how} the source vbvr:{src}" in errors[0], result.output
    assert _listing(source.parent) == before  # nothing written, not even OUT's folder


def test_store_urls_that_overlap_are_refused_without_a_request(tiny_model) -> None:
    """No endpoint is reachable here (none is set): the refusal comes before any request."""
    result = CliRunner().invoke(
        app,
        ["build", "--source", "vbvr:s3://bucket/clips", "--model", str(tiny_model), "--out", "s3://bucket/clips/x"],
    )
    assert result.exit_code == EXIT_USAGE, result.output
    assert "--out s3://bucket/clips/x is inside the source vbvr:s3://bucket/clips" in result.output


def test_an_out_beside_the_source_is_not_refused(source, tiny_model, tmp_path) -> None:
    result = CliRunner().invoke(
        app,
        ["build", "--source", f"vbvr:{source}", "--model", str(tiny_model), "--out", str(tmp_path / "clips-cache"),
         "--dry-run"],
    )  # fmt: skip
    assert "apart from the source" not in result.output, result.output
