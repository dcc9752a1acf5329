"""Prompt text: strict UTF-8, surrounding whitespace stripped, never empty, at most `MAX_PROMPT_BYTES`.

A prompt longer than the tokenizer's max_length is kept (the embedding holds its first max_length tokens; the
row records ``truncated`` and the token count). One larger than `MAX_PROMPT_BYTES` is refused: counting its tokens
would cost time and memory that no embedding uses."""

from __future__ import annotations

from infra.errors import InputError

#: A prompt file over this size is refused (``prompt_too_long``), by a source before it is read where it can.
MAX_PROMPT_BYTES = 1 << 20


def decode_prompt(raw: bytes | None) -> str:
    """Bytes of a prompt file → the prompt, or InputError(missing/empty/not UTF-8)."""
    if raw is None:
        raise InputError("missing_prompt", "the sample has no prompt file")
    if len(raw) > MAX_PROMPT_BYTES:
        raise InputError("prompt_too_long", f"the prompt has {len(raw)} bytes, over {MAX_PROMPT_BYTES}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError("prompt_not_utf8", f"prompt is not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    text = text.removeprefix("\ufeff").strip()
    if not text:
        raise InputError("empty_prompt", "the prompt is empty or only whitespace")
    return text
