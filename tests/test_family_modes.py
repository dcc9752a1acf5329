"""Families own their modes: a family declares the modes it makes and the roles each reads
(`infra.models.base.FamilySpec.mode_roles`, LTX-2's in `infra.models.ltx2_modes`), and the generic stages ask for
roles; none of them names a mode. The modes the command line and the config accept are exactly the families'.

``python tests/test_family_modes.py`` prints every mode name a generic stage holds in its code."""

from __future__ import annotations

import ast
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from flows.cli_options import field_option
from infra.config import EncodingConfig, Mode
from infra.models import FAMILIES, ROLES, FamilySpec, declared_modes, get_family, mode_roles

ROOT = Path(__file__).resolve().parents[1]

#: The generic stages: they know roles (`infra.models.base.ROLES`) and output kinds, never a mode's name.
GENERIC = ("infra/plan.py", "infra/preprocess", "infra/formats", "infra/audit", "infra/gates", "infra/sources")
#: Where a mode may be named: the families (`infra/models/`), the config's `Mode` (`infra/config.py`, what the
#: command line accepts: `test_the_accepted_modes_are_the_families`), and documentation (docstrings, comments).
MODES = typing.get_args(Mode)


def mode_pattern(modes: tuple[str, ...]) -> re.Pattern[str]:
    """A mode's name as a word of its own (``i2v`` in ``--mode i2v``, not in ``wan21_i2v``)."""
    names = "|".join(re.escape(m) for m in sorted(modes, key=len, reverse=True))
    return re.compile(rf"(?<![\w-])({names})(?![\w-])")


def _docstrings(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def mode_names(text: str, pattern: re.Pattern[str]) -> Iterator[tuple[int, str]]:
    """(line, mode) for each mode named in a string of `text`'s code (an f-string's text too), docstrings aside."""
    tree = ast.parse(text)
    docs = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield from ((node.lineno, found) for found in pattern.findall(node.value))


def generic_files(root: Path = ROOT) -> list[Path]:
    files: list[Path] = []
    for name in GENERIC:
        path = root / name
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return files


def offenders(root: Path = ROOT) -> list[str]:
    pattern = mode_pattern(MODES)
    return [
        f"{path.relative_to(root)}:{line}: {mode}"
        for path in generic_files(root)
        for line, mode in mode_names(path.read_text(encoding="utf-8"), pattern)
    ]


def test_no_generic_stage_names_a_mode():
    assert generic_files(), "the generic stages moved: update GENERIC"
    assert offenders() == [], "a generic stage names a mode: ask the family for its roles (FamilySpec.roles)"


def test_the_scan_finds_a_mode_named_in_code():
    pattern = mode_pattern(MODES)
    code = (
        '"""A docstring may say --mode t2a."""\n# so may a comment: v2a\n'
        'if mode == "t2a" or f"--mode av2av-ic-lora {x}":\n    pass\n'
    )
    assert [mode for _, mode in mode_names(code, pattern)] == ["t2a", "av2av-ic-lora"]
    assert list(mode_names('x = "wan21_i2v_model"; y = "t2v-a14b"', pattern)) == []


def test_the_accepted_modes_are_the_families():
    declared = {mode for name in FAMILIES.names() for mode in get_family(name).modes}
    assert set(MODES) == declared == set(declared_modes())
    assert tuple(MODES) == declared_modes()  # the order too: the messages that list modes follow it
    option = field_option("mode", EncodingConfig.model_fields["mode"])  # the command line's --mode: its choices
    given = typing.get_args(typing.get_args(option.annotation)[0])  # Annotated[Mode | None, Option] → (Mode, None)
    (accepted,) = [typing.get_args(kind) for kind in given if kind is not type(None)]
    assert set(accepted) == declared
    for mode in MODES:
        EncodingConfig(mode=mode)
    with pytest.raises(ValueError, match="mode"):
        EncodingConfig(mode="x2y")


def test_a_mode_reads_the_same_roles_in_every_family():
    for name in FAMILIES.names():
        family = get_family(name)
        for mode in family.modes:
            roles = family.roles(mode)
            assert roles == mode_roles(mode) and set(roles) <= set(ROLES), (name, mode)
            assert "caption" in roles and ("video" in roles or "audio" in roles), (name, mode)
    assert {get_family("ltx2").roles(mode) for mode in ("t2a", "a2a-ic-lora", "audio-inpaint")} == {
        ("audio", "caption"),
        ("audio", "reference_audio", "caption"),
        ("audio", "audio_mask", "caption"),
    }


if __name__ == "__main__":
    for line in offenders():
        print(line)
    print(f"{len(offenders())} mode names in the code of the generic stages")


def test_a_family_that_gives_a_mode_other_roles_fails_at_its_definition():
    with pytest.raises(TypeError, match=r"--mode t2a reads video, caption, where another family's reads audio"):

        class Other(FamilySpec):
            name, components, latent_norm = "other", ("vae",), "z"
            mode_roles: ClassVar[dict[str, tuple[str, ...]]] = {"t2a": ("video", "caption")}

    with pytest.raises(TypeError, match="roles not in ROLES: smell"):

        class Smelly(FamilySpec):
            name, components, latent_norm = "smelly", ("vae",), "z"
            mode_roles: ClassVar[dict[str, tuple[str, ...]]] = {"t2v": ("video", "smell")}
