"""Encode one sample: prompt → video → frames → pixels → the family's encoders → an EncodedSample.

The same function serves the preprocess, the one-sample sanity, the dry run and the decode-and-verify
re-derivation of source frames, so every step sees the recipe's exact numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from infra.devices import resolve_device, resolve_dtype
from infra.errors import InputError, ModelLoadError
from infra.formats import EncodedSample
from infra.gates.plan import BuildPlan
from infra.media.prompts import decode_prompt
from infra.media.video import frames_to_pixels, sample_frames
from infra.models import LoadedFamily, load_family
from infra.sources import SampleRef


def load_encoder(plan: BuildPlan) -> LoadedFamily:
    """The plan's family, loaded once per process on the configured device."""
    cfg = plan.config
    try:
        device, dtype = resolve_device(cfg.device), resolve_dtype(cfg.dtype)
        return load_family(Path(cfg.model).expanduser(), plan.family, device, dtype)
    except Exception as exc:
        raise ModelLoadError(f"cannot load {plan.family} from {cfg.model}: {type(exc).__name__}: {exc}") from exc


def encode_sample(
    ref: SampleRef, plan: BuildPlan, get_encoder: Callable[[], LoadedFamily]
) -> tuple[EncodedSample, dict]:
    """Decode, sample, resize and encode one sample. Raises InputError for bad input.

    Inputs are checked before the model is asked for, so a run of bad inputs never loads a model."""
    cfg = plan.config
    if "layout_error" in ref.extra:
        raise InputError("bad_layout", ref.extra["layout_error"])
    prompt = decode_prompt(ref.read_prompt())
    media = ref.read_media()
    if media is None:
        raise InputError("missing_video", "the sample has no video file")
    clip = sample_frames(media, cfg.frames)
    pixels = frames_to_pixels(clip.frames, cfg.height, cfg.width)
    encoder = get_encoder()
    latents = encoder.encode_video(pixels)
    text = encoder.encode_text(prompt, cfg.text_max_length, zero_padding=cfg.text_padding == "zeros")
    sample = EncodedSample(
        id=ref.id,
        group=ref.group,
        prompt=prompt,
        latents=latents,
        text_embeds=text.embeds,
        seq_len=text.seq_len,
        source_shape=clip.source_shape,
        fingerprint=plan.fingerprint,
    )
    return sample, {"tokens_total": text.tokens_total, "truncated": text.truncated}
