"""The user pages stay true: the configuration reference is what the config models and the command line say
(regenerated and compared: ``make docs`` when it fails), every relative link of the project's markdown pages
resolves (the file, and the heading an ``#anchor`` names), and the README stays a ten-minute read."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field, create_model

from flows import config_reference
from infra.config import BuildConfig

ROOT = Path(__file__).resolve().parents[1]
#: The pages a user reads: the README, docs/, the bench results, the architecture and reliability notes.
PAGES = sorted(
    [
        *(ROOT / name for name in ("README.md", "ARCHITECTURE.md", "RELIABILITY.md", "bench/README.md")),
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "infra" / "deploy").rglob("README.md"),
    ]
)
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
CODE = re.compile(r"^(```|~~~)")
README_LINES = 400


def test_the_configuration_reference_is_current():
    page = config_reference.PAGE.read_text(encoding="utf-8")
    assert page == config_reference.render(), "docs/config.md is stale: run `make docs`"


def test_the_reference_shows_every_setting_with_its_flag_default_and_bounds():
    page = config_reference.render()
    for name, field in BuildConfig.settings().items():
        section = getattr(field.annotation, "__args__", (field.annotation,))[0]
        if isinstance(section, type) and issubclass(section, BaseModel):  # upload, alerts: nested sections
            assert f"## `{name}`" in page and all(f"| `{name}.{key}` |" in page for key in section.model_fields)
        else:
            assert re.search(rf"^\| `{name}` \|", page, re.MULTILINE), name
    assert "| `frames` | `--frames` | integer, > 0, ≤ 10,000 | `33` |" in page
    assert "`--audio` `--no-audio` `--skip-audio`" in page  # the option's own spellings, off_flags included
    assert "| `upload.to` | `--upload` `--to` |" in page  # the build's one-flag form and upload's own option


def test_field_metadata_shows_without_a_change_to_the_generator():
    """What another engineer declares in a Field's json_schema_extra reaches the page as it is."""
    declared = {"spec_name": "frames", "absent": None}
    model = create_model(
        "Marked", frames=(int, Field(33, gt=0, le=100, description="Frames", json_schema_extra=declared))
    )
    field = model.model_fields["frames"]
    row = config_reference.row(config_reference.Setting("frames", field, ("--frames",), ("build",), True))
    assert row == (
        "| `frames` | `--frames` | integer, > 0, ≤ 100 | `33` | Frames. *Spec.* *Taken by:* build. "
        "*Declared:* spec_name: frames; absent: None. |"
    )


def _unescaped(text: str) -> set[str]:
    """The markdown punctuation of `text` that no backslash escapes."""
    found, escaped = set(), False
    for char in text:
        if not escaped and char in "*|_`":
            found.add(char)
        escaped = not escaped and char == "\\"
    return found


def _cells(row: str) -> int:
    """The cells of a markdown table row: pipes not escaped (an even run of backslashes before them) split it."""
    boundaries = [m for m in re.finditer(r"(\\*)\|", row) if len(m[1]) % 2 == 0]
    return len(boundaries) - 1


@settings(max_examples=60, deadline=None)
@example("a\\|b *c* <key>.npy\nnext")  # an escaped pipe, emphasis, a tag, a line break
@given(st.text(alphabet=st.sampled_from("\\|*<>_`[]a \n\r") | st.characters(codec="utf-8"), max_size=80))
def test_any_description_stays_one_row_of_five_cells(description):
    """A description holding pipes, backslashes, tags, asterisks or line breaks cannot break the reference's table."""
    field = create_model("Any", x=(int | None, Field(None, description=description))).model_fields["x"]
    row = config_reference.row(config_reference.Setting("x", field, ("--x",), ("build",), False))
    assert "\n" not in row and "\r" not in row and _cells(row) == 5, row
    cell = config_reference._cell(description)
    assert "<" not in cell and _unescaped(cell) <= {"_", "`"}, cell  # markup that cannot open emphasis or a cell


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = "".join(c for c in text.lower() if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown text's headings (outside code blocks), duplicates numbered as GitHub does."""
    found: set[str] = set()
    fenced = False
    for line in text.splitlines():
        if CODE.match(line):
            fenced = not fenced
        elif not fenced and (match := HEADING.match(line)):
            slug = base = _slug(match[1])
            n = 0
            while slug in found:
                n += 1
                slug = f"{base}-{n}"
            found.add(slug)
    return found


def links(text: str) -> list[str]:
    """The link targets of a markdown text, outside code blocks and inline code."""
    kept = []
    fenced = False
    for line in text.splitlines():
        if CODE.match(line):
            fenced = not fenced
        elif not fenced:
            kept.append(re.sub(r"`[^`]*`", "", line))
    return LINK.findall("\n".join(kept))


def broken_links(page: Path) -> list[str]:
    """Every relative link of `page` whose file or heading is not there."""
    broken = []
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text(encoding="utf-8")):
            broken.append(f"{target} (no heading #{anchor})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_link_check_sees_a_broken_file_and_a_broken_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Quick start: `wan22`\n\n## Quick start: `wan22`\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#quick-start-wan22) [dup](a.md#quick-start-wan22-1) [web](https://x.org/y) `[code](gone.md)`\n"
        "[gone](gone.md) [bad](a.md#nothing)\n```\n[fenced](gone.md)\n```\n"
    )
    assert [b.split(" ")[0] for b in broken_links(page)] == ["gone.md", "a.md#nothing"]


def test_the_readme_is_a_ten_minute_read_that_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_LINES
    first_block = text[text.index("```") : text.index("```", text.index("```") + 3)]
    assert "make demo" in first_block and "make test" in first_block
