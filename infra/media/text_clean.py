"""Prompt cleaning a trainer applies before its tokenizer (the spec's ``text_clean``; none by default).

``whitespace``: the Wan tokenizers' ``clean="whitespace"``, which both musubi-tuner (``wan/modules/tokenizers.py`` at
commit 30c658c4f4b0bf05038b3346eff9670259b10fc7) and DiffSynth (``diffsynth`` 2.1.12,
``models/wan_video_text_encoder.py``) apply to every prompt: ``ftfy.fix_text``, HTML entities unescaped twice,
stripped, then every run of whitespace made one space. The stored prompt stays the caption as given (musubi's
``caption1``); only what the tokenizer reads is cleaned.
"""

from __future__ import annotations

import html
import importlib.util
import re
from collections.abc import Callable

from infra.errors import ConfigError

_RUNS = re.compile(r"\s+")


def _whitespace(text: str) -> str:
    import ftfy  # noqa: PLC0415 - optional: the `wan` extra, for the Wan trainers' formats only

    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return _RUNS.sub(" ", text).strip()


CLEANERS: dict[str, Callable[[str], str]] = {"whitespace": _whitespace}


def require(name: str | None) -> None:
    """ConfigError for a cleaning this install cannot do (an unknown name, or ftfy missing), before anything runs."""
    if name is None:
        return
    if name not in CLEANERS:
        raise ConfigError(f"unknown text cleaning {name!r}; known: {', '.join(CLEANERS)}")
    if importlib.util.find_spec("ftfy") is None:
        raise ConfigError(
            "the Wan trainers clean every prompt with ftfy before tokenizing it: pip install 'latentforge[wan]'"
        )


def clean(text: str, name: str | None) -> str:
    """`text` as the tokenizer of a trainer cleaning by `name` reads it (None: as it is)."""
    return text if name is None else CLEANERS[name](text)
