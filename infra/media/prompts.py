"""Prompt text: strict UTF-8, surrounding whitespace stripped, never empty (unless ``--empty-captions encode``, as
the LTX-2 trainer), at most `MAX_PROMPT_BYTES`; the trainer's caption handling (`caption_prompt`: its LLM openings
removed, its LoRA trigger prepended).

A prompt longer than the tokenizer's max_length is kept (the embedding holds its first max_length tokens; the
row records ``truncated`` and the token count). One larger than `MAX_PROMPT_BYTES` is refused: counting its tokens
would cost time and memory that no embedding uses."""

from __future__ import annotations

from dataclasses import dataclass

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


#: The LTX-2 trainer's ``COMMON_LLM_START_PHRASES`` (ltx-trainer ``scripts/process_captions.py``): five openings,
#: then every beginning × continuation in this order. ``--remove-llm-prefixes`` removes the first that opens a caption.
_BEGINNINGS = (
    "This video", "The video", "This clip", "The clip", "The animation", "This image", "The image", "This picture",
    "The picture",
)  # fmt: skip
_CONTINUATIONS = ("shows", "depicts", "features", "captures", "highlights", "introduces", "presents")
LLM_START_PHRASES: tuple[str, ...] = (
    "In the video,",
    "In this video,",
    "In this video clip,",
    "In the clip,",
    "Caption:",
    *(f"{beginning} {continuation}" for beginning in _BEGINNINGS for continuation in _CONTINUATIONS),
)


def remove_llm_prefix(text: str) -> str:
    """The trainer's cleaning: stripped, the first matching opening (case-sensitive, a plain prefix) removed and
    the rest stripped."""
    text = text.strip()
    for phrase in LLM_START_PHRASES:
        if text.startswith(phrase):
            return text.removeprefix(phrase).strip()
    return text


@dataclass(frozen=True)
class CaptionRules:
    """How a caption becomes the prompt (the spec's ``lora_trigger``, ``remove_llm_prefixes``, ``empty_captions``)."""

    lora_trigger: str | None = None
    remove_llm_prefixes: bool = False
    empty_captions: str = "skip"

    @classmethod
    def of(cls, spec: object) -> CaptionRules:
        """The rules of a `CacheSpec` (or anything with its names; absent ones: latentforge's defaults)."""
        return cls(
            getattr(spec, "lora_trigger", None),
            bool(getattr(spec, "remove_llm_prefixes", False)),
            getattr(spec, "empty_captions", "skip"),
        )


def caption_prompt(raw: bytes | None, rules: CaptionRules) -> str:
    """A caption's bytes → the prompt as the LTX-2 trainer makes it: the LLM opening removed (if asked), then the
    trigger and one space prepended (``f"{trigger.strip()} {caption}"``). An empty caption is `decode_prompt`'s
    ``empty_prompt`` unless ``empty_captions`` is ``encode`` (the trainer encodes it: the prompt is the trigger
    and its space, or ``""``)."""
    try:
        text = decode_prompt(raw)
    except InputError as exc:
        if exc.reason != "empty_prompt" or rules.empty_captions != "encode":
            raise
        text = ""
    if rules.remove_llm_prefixes:
        text = remove_llm_prefix(text)
        if not text and rules.empty_captions != "encode":
            raise InputError("empty_prompt", "the caption is empty once its LLM opening is removed")
    trigger = rules.lora_trigger.strip() if rules.lora_trigger else ""
    return f"{trigger} {text}" if trigger else text
