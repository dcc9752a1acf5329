"""A tiny, offline, deterministic stand-in for the ``Wan-AI/Wan2.2-TI2V-5B-Diffusers`` snapshot.

``make_tiny_wan22`` writes the encoding half of that snapshot (``model_index.json``, ``vae/``,
``text_encoder/``, ``tokenizer/``, ``scheduler/``; no ``transformer/``) with the real Wan2.2 VAE geometry
(z_dim 48, 16x spatial / 4x temporal compression, real latent statistics) but random, very small weights.
Nothing is downloaded. The same seed gives byte-identical files.

``make_wan22(size="full")`` writes the same layout at the real sizes (the Wan2.2 VAE's own config, a UMT5-XXL
text encoder), random weights from the same seed: the FLOPs and memory of the real models, for
`bench/gpu_bench.py`. On an accelerator it builds them there, in its dtype (seconds, not the minutes of a CPU).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import string
from collections import Counter
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import diffusers
import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import Unigram
from transformers import AutoTokenizer, PreTrainedTokenizerBase, T5TokenizerFast, UMT5Config, UMT5EncoderModel

from infra.demo.vae_fit.train import FitSettings, fit_vae
from infra.models.wan_constants import WAN22_VAE_CONFIG
from infra.storage import staged_dir

logger = logging.getLogger(__name__)

TINY_VAE_OVERRIDES = {"base_dim": 8, "decoder_base_dim": 8, "num_res_blocks": 1}
#: The tiny UMT5's sizes (its vocabulary is the tokenizer's, rounded up to 128).
TINY_UMT5 = {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4}
SIZES = ("tiny", "full")
#: UMT5-XXL (google/umt5-xxl, Wan2.2's text encoder) as its config gives it: 5.7 B parameters.
UMT5_XXL = {
    "vocab_size": 256384,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_decoder_layers": 24,
    "num_heads": 64,
}
TOKENIZER_VOCAB_SIZE = 2000
SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2 as in T5/UMT5
_MAX_PIECE_CHARS = 8

# Word lists for the embedded training corpus (see _corpus_words).
# fmt: off
_COLOURS = (
    "red", "orange", "yellow", "green", "blue", "purple", "pink", "white", "black", "grey", "brown",
    "golden", "silver", "cyan", "teal",
)
_OBJECTS = (
    "ball", "cube", "sphere", "cylinder", "pyramid", "marble", "robot", "drone", "car", "train", "boat",
    "bird", "cat", "dog", "pendulum", "domino", "wheel", "block", "rocket", "balloon", "feather", "leaf",
    "droplet", "spring", "gear", "magnet", "planet",
)
_MOTIONS = (
    "rolls through", "bounces across", "slides along", "falls onto", "spins above", "floats over",
    "drifts past", "collides with", "rotates around", "moves through", "jumps over", "orbits", "pushes",
    "follows", "escapes from", "climbs", "sinks into",
)
_PLACES = (
    "a narrow maze", "the wooden table", "a grassy field", "a dark room", "the spiral ramp", "a glass tube",
    "the checkered floor", "a sandy beach", "the winding corridor", "a frozen lake", "the labyrinth walls",
    "a metal track", "the night sky",
)
_MANNERS = (
    "slowly", "quickly", "smoothly", "erratically", "gently", "under gravity", "with friction",
    "after an elastic collision", "at constant velocity", "while accelerating", "as the camera pans left",
    "as the camera zooms in", "in bright sunlight", "casting a long shadow", "and comes to rest",
    "losing momentum", "reflecting the light",
)
# fmt: on
_EXTRA_LINES = (
    "The quick brown fox jumps over the lazy dog.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 12 24 48 100 and symbols ( ) [ ] , . ; : ! ? ' \" - + = / %",
    "A video of a person walking; frames, pixels, latents, noise, motion blur, depth, velocity, energy.",
)


def _corpus_words() -> Counter[str]:
    """Word counts of the embedded corpus: 4096 deterministic sentences mixing the word lists."""
    counts: Counter[str] = Counter()
    for i in range(4096):
        colour, obj = _COLOURS[i % len(_COLOURS)], _OBJECTS[7 * i % len(_OBJECTS)]
        motion, place = _MOTIONS[11 * i % len(_MOTIONS)], _PLACES[5 * i % len(_PLACES)]
        counts.update(f"A {colour} {obj} {motion} {place} {_MANNERS[3 * i % len(_MANNERS)]}.".split())
    for line in _EXTRA_LINES:
        counts.update(line.split())
    return counts


def _unigram_vocab(vocab_size: int) -> list[tuple[str, float]]:
    """Unigram pieces with log-frequency scores, T5-style: specials first, then pieces by score.

    Candidates are all whitespace-bounded substrings (up to 8 chars, plus whole words) of the ``▁``-prefixed
    corpus words, counted by word frequency, i.e. the seed step of SentencePiece's unigram training. It is
    done here in Python because ``tokenizers.trainers.UnigramTrainer`` is not deterministic across
    processes and keeps only ~280 pieces on a corpus this small.
    """
    pieces: Counter[str] = Counter()
    for word, n in _corpus_words().items():
        marked = "▁" + word
        for i, j in itertools.combinations(range(len(marked) + 1), 2):
            if j - i <= _MAX_PIECE_CHARS or (i == 0 and j == len(marked)):
                pieces[marked[i:j]] += n
    alphabet = [ch for ch in string.printable if not ch.isspace()] + ["▁"]
    chosen = dict.fromkeys(alphabet)  # every ASCII character stays encodable without <unk>
    for piece, _ in sorted(pieces.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= vocab_size - len(SPECIAL_TOKENS):
            break
        chosen.setdefault(piece)
    total = sum(pieces.values())
    scores = {p: round(math.log(max(pieces[p], 1) / total), 6) for p in chosen}
    scored = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))
    return [(tok, 0.0) for tok in SPECIAL_TOKENS] + scored


def build_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> PreTrainedTokenizerBase:
    """Build a small T5/UMT5-style Unigram tokenizer offline (``<pad>``=0, ``</s>``=1, ``<unk>``=2).

    The backend matches what transformers 5 ``T5Tokenizer`` rebuilds from ``tokenizer.json`` on load
    (no normalizer, WhitespaceSplit + Metaspace, ``$A </s>`` post-processor), so a reloaded tokenizer
    encodes exactly like this one.
    """
    backend = Tokenizer(Unigram(_unigram_vocab(vocab_size), unk_id=2, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    backend.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)]
    )
    return T5TokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_ids=0
    )


def _load_local_tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    # A missing path would otherwise be taken for a Hub repo id; never go online from here.
    if not tokenizer_dir.is_dir():
        raise FileNotFoundError(f"tokenizer_dir {tokenizer_dir} is not a directory")
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@dataclass(frozen=True)
class _Build:
    """What `make_wan22` builds: the size, the device its weights are made on (None: the CPU), their dtype."""

    size: str = "tiny"
    device: str | None = None
    dtype: torch.dtype = torch.float32


def _on(device: str | None) -> AbstractContextManager:
    """Where new weights are made: the default (CPU) when None, else `device` (the random init runs there)."""
    return torch.device(device) if device is not None else nullcontext()


def _write_vae(
    out: Path, seed: int, fit_to: list[torch.Tensor] | None, settings: FitSettings | None, build: _Build
) -> None:
    kwargs = {k: v for k, v in WAN22_VAE_CONFIG.items() if k != "clip_output"}
    kwargs |= TINY_VAE_OVERRIDES if build.size == "tiny" else {}
    torch.manual_seed(seed)
    with _on(build.device):
        vae = AutoencoderKLWan(**kwargs)
    if build.dtype != torch.float32:  # made in float32 (diffusers warns on any cast, wanted or not)
        vae = vae.to(build.dtype)
    if fit_to:
        result = fit_vae(vae, fit_to, settings or FitSettings(seed=seed))
        logger.info(
            "fitted the tiny VAE to %d clip(s): %d steps in %.1f s (closed-form start %.1f s), crop PSNR %.1f dB",
            len(fit_to),
            result.steps,
            result.seconds,
            result.init_seconds,
            result.crop_psnr or float("nan"),
        )
    vae.register_to_config(clip_output=WAN22_VAE_CONFIG["clip_output"])  # as in the real vae/config.json
    vae.save_pretrained(out, safe_serialization=True)
    logger.info("%s vae: %d parameters", build.size, sum(p.numel() for p in vae.parameters()))


def _write_text_encoder(out: Path, seed: int, vocab_size: int, build: _Build) -> None:
    tiny = {**TINY_UMT5, "vocab_size": -(-vocab_size // 128) * 128}
    config = UMT5Config(
        **(tiny if build.size == "tiny" else UMT5_XXL),
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.1,
        layer_norm_epsilon=1e-6,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    torch.manual_seed(seed)
    with _on(build.device):
        model = UMT5EncoderModel(config).to(build.dtype).eval()
    model.save_pretrained(out, safe_serialization=True)
    logger.info("%s text encoder: %d parameters, vocab %d", build.size, model.num_parameters(), config.vocab_size)


def _write_model_index(out_dir: Path) -> None:
    index = {
        "_class_name": "WanPipeline",
        "_diffusers_version": diffusers.__version__,
        "boundary_ratio": None,
        "expand_timesteps": True,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def make_tiny_wan22(
    out_dir: Path,
    *,
    seed: int = 0,
    tokenizer_dir: Path | None = None,
    fit_to: list[torch.Tensor] | None = None,
    fit_settings: FitSettings | None = None,
) -> Path:
    """Write a tiny Wan2.2-TI2V-5B-Diffusers-layout pipeline (without transformer) into ``out_dir``: `make_wan22`
    at ``size="tiny"`` on the CPU in float32."""
    return make_wan22(out_dir, seed=seed, tokenizer_dir=tokenizer_dir, fit_to=fit_to, fit_settings=fit_settings)


def make_wan22(
    out_dir: Path,
    *,
    size: str = "tiny",
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tokenizer_dir: Path | None = None,
    fit_to: list[torch.Tensor] | None = None,
    fit_settings: FitSettings | None = None,
) -> Path:
    """Write a Wan2.2-TI2V-5B-Diffusers-layout pipeline (without transformer) into ``out_dir``: ``size`` tiny
    (small weights, the real VAE geometry) or full (the real sizes), random weights made on `device` (None: the
    CPU) and saved in `dtype`.

    ``fit_to`` (clips as pixels in [-1, 1], one geometry) fits the VAE to them (`infra.demo.vae_fit`) so that
    it reconstructs them recognisably; otherwise its weights are the seed's random ones.

    ``tokenizer_dir`` (a local tokenizer folder, e.g. a real UMT5 one) replaces the built-in tokenizer; the
    text encoder's vocabulary is sized to it. ``out_dir`` must be absent or empty: nothing is overwritten.
    Files are built in a sibling temporary folder and moved into place at the end, so a failure leaves no
    partial pipeline. Returns ``out_dir``.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if fit_to and size != "tiny":
        raise ValueError("fit_to fits the tiny VAE only")
    build, out_dir = _Build(size, device, dtype), Path(out_dir)
    with staged_dir(out_dir, f"the {size} Wan2.2 pipeline") as staging:
        tokenizer = build_tokenizer() if tokenizer_dir is None else _load_local_tokenizer(Path(tokenizer_dir))
        tokenizer.save_pretrained(staging / "tokenizer")
        _write_vae(staging / "vae", seed, fit_to, fit_settings, build)
        _write_text_encoder(staging / "text_encoder", seed, len(tokenizer), build)
        UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=5.0
        ).save_pretrained(staging / "scheduler")
        _write_model_index(staging)
    logger.info("wrote %s Wan2.2 pipeline to %s (seed %d, %d tokens)", size, out_dir, seed, len(tokenizer))
    return out_dir
