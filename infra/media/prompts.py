"""Prompt text: strict UTF-8, surrounding whitespace stripped, never empty."""

from __future__ import annotations

from infra.errors import InputError


def decode_prompt(raw: bytes | None) -> str:
    """Bytes of a prompt file → the prompt, or InputError(missing/empty/not UTF-8)."""
    if raw is None:
        raise InputError("missing_prompt", "the sample has no prompt file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError("prompt_not_utf8", f"prompt is not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    text = text.removeprefix("\ufeff").strip()
    if not text:
        raise InputError("empty_prompt", "the prompt is empty or only whitespace")
    return text
