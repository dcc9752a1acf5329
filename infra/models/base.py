"""The Family contract: what a model family declares and what its loaded encoder does."""

from __future__ import annotations

import inspect
import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from infra.config import CacheSpec
from infra.errors import ConfigError

#: The roles a sample can read (the dataset's columns, by the names the LTX-2 trainer gives them) → the output kind
#: each is written as, in the order a sample's kinds are listed. A family's modes say which roles each reads
#: (`FamilySpec.mode_roles`); the stages below the plan know roles and kinds, never a mode's name.
ROLES: dict[str, str] = {
    "video": "latents",
    "caption": "text_embeddings",
    "audio": "audio_latents",
    "reference_video": "reference_latents",
    "reference_audio": "reference_audio_latents",
    "video_mask": "video_masks",
    "audio_mask": "audio_masks",
}
#: What each role's file is, so the stages know how to read and encode it: a video (the VAE), an audio file (the
#: audio encoder), the caption (the text encoder), a mask laid on the video's or the audio's latents.
ROLE_MEDIA: dict[str, str] = {
    "video": "video",
    "caption": "text",
    "audio": "audio",
    "reference_video": "video",
    "reference_audio": "audio",
    "video_mask": "video_mask",
    "audio_mask": "audio_mask",
}
#: Held around every tokenizer call: a fast tokenizer keeps its padding and truncation as state of its one Rust
#: backend, so a call from one shard thread could tokenize with another's (an unpadded prompt: a [seq_len, D] text).
TOKENIZER_LOCK = threading.Lock()

#: What every family makes, its default mode: a video and its caption.
DEFAULT_MODE = "t2v"
TEXT_TO_VIDEO: tuple[str, ...] = ("video", "caption")
#: The image-to-video mode of a family that `FamilySpec.takes_image`: a video and its caption (the first frame's
#: conditioning is made from the video).
IMAGE_TO_VIDEO = "i2v"

#: Every mode a family declares → its roles, as the families are defined (`FamilySpec.__init_subclass__`): a mode's
#: name means the same roles in every family that makes it.
_DECLARED: dict[str, tuple[str, ...]] = {DEFAULT_MODE: TEXT_TO_VIDEO}


def mode_roles(mode: str) -> tuple[str, ...]:
    """The roles a sample of `mode` reads, as every family that makes `mode` declares them."""
    return _DECLARED[mode]


def declared_modes() -> tuple[str, ...]:
    """Every mode some family declares, in the order they were declared."""
    return tuple(_DECLARED)


def role_kinds(roles: Sequence[str], audio: bool) -> tuple[str, ...]:
    """The output kinds a sample reading `roles` holds, in a stable order; `audio` (the spec's) adds audio latents
    to a mode that reads no audio of its own."""
    kinds = [kind for role, kind in ROLES.items() if role in roles]
    if audio and ROLES["audio"] not in kinds:
        kinds.insert(kinds.index(ROLES["caption"]) + 1, ROLES["audio"])
    return tuple(kinds)


@dataclass(frozen=True)
class GeometryRules:
    """frames ≡ frame_remainder (mod frame_multiple); height and width multiples of spatial_multiple."""

    frame_multiple: int
    frame_remainder: int
    spatial_multiple: int

    def check(self, family: str, frames: int, height: int, width: int) -> None:
        """Raise ConfigError naming each bad value and the nearest valid ones."""
        problems = []
        if frames % self.frame_multiple != self.frame_remainder % self.frame_multiple:
            lower = frames - (frames - self.frame_remainder) % self.frame_multiple
            problems.append(
                f"frames={frames} (needs frames ≡ {self.frame_remainder} mod {self.frame_multiple}): "
                f"nearest valid {_nearest(lower, lower + self.frame_multiple)}"
            )
        for name, value in (("height", height), ("width", width)):
            if value % self.spatial_multiple:
                lower = value - value % self.spatial_multiple
                problems.append(
                    f"{name}={value} (needs a multiple of {self.spatial_multiple}): "
                    f"nearest valid {_nearest(lower, lower + self.spatial_multiple)}"
                )
        if problems:
            raise ConfigError(f"geometry not valid for family {family}: " + "; ".join(problems))


def _nearest(lower: int, upper: int) -> str:
    return f"{lower} or {upper}" if lower >= 1 else f"{upper}"


@dataclass(frozen=True)
class TextSettings:
    """How prompts are encoded: tokenizer max_length, what is stored at pad positions (``raw`` | ``zeros``), which
    tensor (``last_hidden_state``; LTX-2: ``pre_connector`` | ``post_connector``) and the cleaning a trainer applies
    before its tokenizer (the Wan trainers' ``whitespace``; families that read it: wan22, wan21)."""

    max_length: int
    padding: str = "raw"
    stage: str = "last_hidden_state"
    clean: str | None = None  # what the tokenizer reads: the prompt cleaned by `infra.media.text_clean` (a trainer's)

    @classmethod
    def of(cls, spec: CacheSpec) -> TextSettings:
        """The text settings a spec was made with."""
        return cls(spec.text_max_length, spec.text_padding, spec.text_stage, spec.text_clean)


@dataclass(frozen=True)
class TextEmbedding:
    """One prompt's embedding: (max_length, D) on CPU, stored dtype, plus token accounting. `extras` holds what a
    family stores beside it (LTX-2: the attention mask and the audio prompt embedding)."""

    embeds: torch.Tensor
    seq_len: int
    tokens_total: int
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def truncated(self) -> bool:
        return self.tokens_total > self.embeds.shape[0]


@dataclass(frozen=True)
class ImageConditioning:
    """What an image-to-video model is conditioned on, made from a clip's first frame (``--mode i2v``); each field is
    the output kind of the same name, None where the model takes none. Float32 on CPU (the writer casts)."""

    #: Wan I2V's ``y`` (musubi's ``latents_image``): 4 mask channels (1 on the first latent frame) then the VAE
    #: latents of the first frame followed by black frames, (4 + C, F', H', W').
    image_latents: torch.Tensor | None = None
    #: The image encoder's features of the first frame (Wan2.1 I2V's CLIP: its penultimate hidden states), (N, D).
    clip_features: torch.Tensor | None = None
    #: The first latent frame (Wan2.2-TI2V-5B fuses it into the latents), (C, 1, H', W').
    first_frame_latents: torch.Tensor | None = None


@dataclass(frozen=True)
class AudioEmbedding:
    """One clip's audio latents (C, T', M) float32 on CPU, the mel they were made from, and its duration (s)."""

    latents: torch.Tensor
    mel: torch.Tensor
    duration: float


class LoadedFamily(ABC):
    """A family with its models loaded on a device. Calls are serialised by the implementation."""

    name: ClassVar[str]

    @abstractmethod
    def encode_video(self, pixels: torch.Tensor) -> torch.Tensor:
        """(1,3,F,H,W) float32 in [-1,1] → normalised latents (C,F',H',W') in the stored dtype, on CPU."""

    def encode_videos(self, pixels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Several clips of one shape, each (1,3,F,H,W) → their latents, in order. This default loops over
        `encode_video` (bit for bit what each gives alone); a family whose VAE takes a batch overrides it with one
        call: then each row equals its batch-one result within the dtype's tolerance, not bit for bit (a kernel's
        blocking depends on the batch size; `infra.preprocess.vae_calls` keeps the batch size fixed)."""
        return [self.encode_video(p) for p in pixels]

    def set_vae_memory(self, *, tiling: bool, slicing: bool) -> None:
        """Turn the VAE's tiling (tiles of each frame encoded apart, blended: changes the numbers) and slicing (a
        batch encoded one sample at a time inside the VAE) on where asked. ConfigError for a family without them."""
        vae = getattr(self, "vae", None)
        for wanted, method in ((tiling, "enable_tiling"), (slicing, "enable_slicing")):
            if not wanted:
                continue
            if vae is None or not callable(getattr(vae, method, None)):
                raise ConfigError(f"family {self.name}: its VAE has no {method}()")
            try:
                getattr(vae, method)()
            except NotImplementedError as exc:
                raise ConfigError(f"family {self.name}: {exc}") from exc

    def load_text_encoder(self) -> torch.nn.Module:
        """The text encoder loaded again from the model's files, on CPU, as the family first loaded it: what
        ``--text-offload`` on CPU brings back after freeing it (`infra.models.memory`)."""
        raise ConfigError(f"family {self.name} cannot load its text encoder again: --text-offload is not for it")

    @abstractmethod
    def encode_text(self, prompt: str, settings: TextSettings) -> TextEmbedding:
        """One prompt → its embedding padded to ``settings.max_length`` (the encoder's own output at the pad
        positions, or zeros there: ``settings.padding``)."""

    def encode_texts(self, prompts: Sequence[str], settings: TextSettings) -> list[TextEmbedding]:
        """Several prompts → their embeddings, each exactly what `encode_text` gives it alone. This default loops;
        a family that can batch (one encoder call for all) overrides it."""
        return [self.encode_text(prompt, settings) for prompt in prompts]

    def encode_audio(self, media: bytes, seconds: float, pad: bool = True) -> AudioEmbedding | None:
        """A clip's audio track, `seconds` long (trimmed, and zero-padded when short unless not `pad`), → its
        latents; None when the file has no audio track; InputError("audio_decode_error") when it cannot be decoded.
        Families without audio: error."""
        raise ConfigError(f"family {self.name} has no audio encoder")

    def encode_conditioning(self, pixels: torch.Tensor, latents: torch.Tensor) -> ImageConditioning:
        """A clip's pixels (1,3,F,H,W) in [-1,1] and its stored latents → what the model's image-to-video mode is
        conditioned on (``--mode i2v`` with a family whose `FamilySpec.conditioning` describes one)."""
        raise ConfigError(f"family {self.name} makes no image-to-video conditioning")

    def decode_audio(self, latents: torch.Tensor) -> torch.Tensor:
        """Stored audio latents → the log-mel spectrogram [C, T, M] they decode to, per channel (the audio check of
        decode-and-verify)."""
        raise ConfigError(f"family {self.name} has no audio decoder")

    def audio_reference(self, media: bytes, seconds: float) -> torch.Tensor | None:
        """The log-mel [C, T, M] of a clip's track as the family's audio front end made it, `seconds` long (what
        `decode_audio` is compared with); None without a track. This default is the LTX-2 trainer's front end."""
        from infra.media.audio import trainer_audio  # noqa: PLC0415 - audio builds only

        prepared = trainer_audio(media, seconds)
        return None if prepared is None else prepared[0]

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Stored latents (C,F',H',W') → pixels (3,F,H,W) float32 in [-1,1], on CPU."""

    def decode_chunks(self, latents: torch.Tensor) -> Iterator[torch.Tensor]:
        """Stored latents → the pixels of `decode`, a chunk of frames (3,f,H,W) at a time, in order, each float32 on
        CPU: decode-and-verify scores and draws each chunk as it comes, so no whole decoded copy is held. This
        default is one chunk, the whole decode; a family whose decode is large (Wan: `infra.models.wan_decode`)
        hands it to the CPU a few frames at a time."""
        yield self.decode(latents)


class FamilySpec(ABC):
    """A family before loading: detection, declared constraints, the components it reads, what it stores."""

    name: ClassVar[str]
    #: Model directory components the cache depends on (their identity is part of the fingerprint).
    components: ClassVar[tuple[str, ...]]
    latent_norm: ClassVar[str]
    #: The output kinds every sample of this family holds (a format says where each kind is stored).
    output_kinds: ClassVar[tuple[str, ...]] = ("latents", "text_embeddings")
    #: Settings the family decides when the user does not: temporal policy, resize policy, text max_length and
    #: text stage (see BuildConfig).
    defaults: ClassVar[dict[str, Any]] = {
        "temporal": "linspace",
        "resize": "stretch",
        "text_max_length": 512,
        "text_stage": "last_hidden_state",
    }
    #: Text stages the family can store (BuildConfig.text_stage); audio: whether it has an audio encoder.
    text_stages: ClassVar[tuple[str, ...]] = ("last_hidden_state",)
    has_audio: ClassVar[bool] = False
    #: What a sample's media is: ``video`` (clips, decoded by PyAV) or ``image`` (stills: one frame, ``frames``
    #: fixed at 1, prepared by `infra.media.image`).
    media: ClassVar[str] = "video"
    #: Stored dtypes of latents and text embeddings the family can write (``--store-dtype``).
    store_dtypes: ClassVar[tuple[str, ...]] = ("bf16",)
    #: Resize policies the family can apply (None: every one of `infra.media.video.RESIZE_POLICIES` its media takes).
    resize_policies: ClassVar[tuple[str, ...] | None] = None
    #: An image family's own preprocessing, in place of the resize policy: a function (upright RGB PIL image,
    #: height, width) → (3, height, width) float32 pixels in [-1, 1] (a plain function or a staticmethod).
    #: The spec records its `preprocess_name`, so a renamed function is a new fingerprint.
    preprocess: ClassVar[Callable[[Any, int, int], torch.Tensor] | None] = None
    #: Whether ``--text-padding zeros`` makes every row past seq_len zero (right padding): then
    #: ``--text-storage trimmed`` can keep the prompt's rows only and restore the padded tensor exactly.
    text_trimmable: ClassVar[bool] = True
    #: Whether `load` takes ``text_encoder_8bit=True`` (``--load-text-encoder-in-8bit``: bitsandbytes, CUDA).
    text_8bit: ClassVar[bool] = False
    #: Whether ``--mode i2v`` stores the model's image conditioning (`conditioning`, `LoadedFamily.encode_conditioning`)
    #: in any format that has a place for it: i2v is then one of its `modes`.
    takes_image: ClassVar[bool] = False
    #: The modes (``--mode``) the family makes → the roles a sample of each reads (`ROLES`); every family makes t2v.
    mode_roles: ClassVar[dict[str, tuple[str, ...]]] = {DEFAULT_MODE: TEXT_TO_VIDEO}

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes the family makes: its `mode_roles`, and i2v where it `takes_image`."""
        own = tuple(self.mode_roles)
        return (*own, IMAGE_TO_VIDEO) if self.takes_image and IMAGE_TO_VIDEO not in own else own

    def roles(self, mode: str) -> tuple[str, ...]:
        """The roles a sample of `mode` reads (a mode of another family: as that family declares it)."""
        return self.mode_roles.get(mode) or mode_roles(mode)

    def check(self, encoding: Any) -> None:
        """ConfigError for settings of `encoding` (an `EncodingConfig`) this family cannot make in its mode. Every
        family makes t2v, and i2v where it `takes_image`: nothing to refuse here; a family with modes of its own
        (LTX-2: `infra.models.ltx2_modes`) checks them."""
        return None

    def kinds(self, spec: Any) -> tuple[str, ...]:
        """The output kinds of a cache of this family made with `spec` (a CacheSpec: audio adds a kind; a mode other
        than t2v has the kinds of its roles, `role_kinds`)."""
        mode, audio = getattr(spec, "mode", DEFAULT_MODE), getattr(spec, "audio", False)
        if mode != DEFAULT_MODE:
            return role_kinds(self.roles(mode), audio)
        return (*self.output_kinds, ROLES["audio"]) if audio else self.output_kinds

    def components_for(self, audio: bool) -> tuple[str, ...]:
        """The components a cache depends on (their identity is in the fingerprint): audio adds the audio VAE."""
        return self.components

    def components_in(self, model_dir: Path, audio: bool = False) -> tuple[str, ...]:
        """The components of this model directory the cache depends on (default: `components_for`); a family
        whose parts are optional (the image family's text encoder) looks at the directory."""
        return self.components_for(audio)

    def model_version(self, model_dir: Path) -> str | None:
        """The version the spec records (`CacheSpec.model_version`); None: nothing beyond the model identity."""
        return None

    def conditioning(self, model_dir: Path, mode: str) -> str | None:
        """What the cache stores for the model's image-to-video conditioning under `mode` (the spec's
        ``conditioning``, in the fingerprint), or None: nothing (LTX-2's i2v takes its first frame from the latents
        at training time). ConfigError for a model that takes no image conditioning in a mode that needs one."""
        return None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared = ("name", "components", "latent_norm")
        missing = [a for a in declared if not inspect.isabstract(cls) and not hasattr(cls, a)]
        if missing:
            raise TypeError(f"family {cls.__name__} does not declare {', '.join(missing)}")
        makes = {**cls.mode_roles, **({IMAGE_TO_VIDEO: TEXT_TO_VIDEO} if cls.takes_image else {})}
        for mode, roles in makes.items():
            if unknown := [role for role in roles if role not in ROLES]:
                raise TypeError(f"family {cls.__name__}: --mode {mode} reads roles not in ROLES: {', '.join(unknown)}")
            if _DECLARED.setdefault(mode, tuple(roles)) != tuple(roles):
                raise TypeError(
                    f"family {cls.__name__}: --mode {mode} reads {', '.join(roles)}, where another family's reads "
                    f"{', '.join(_DECLARED[mode])}: a mode's name means the same roles in every family"
                )

    @abstractmethod
    def matches(self, model_dir: Path, index: dict[str, Any]) -> bool:
        """True when `model_dir` (with its model_index.json) is a model of this family."""

    @abstractmethod
    def rules(self, model_dir: Path) -> GeometryRules:
        """Geometry constraints, read from the model's configs."""

    @abstractmethod
    def latent_shape(self, model_dir: Path, frames: int, height: int, width: int) -> tuple[int, ...]:
        """Shape of one sample's stored latents."""

    @abstractmethod
    def text_shape(self, model_dir: Path, settings: TextSettings) -> tuple[int, ...]:
        """Shape of one sample's stored text embedding."""

    @abstractmethod
    def load(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> LoadedFamily:
        """Load the encoders from local files."""


def preprocess_of(family: FamilySpec) -> Callable[[Any, int, int], torch.Tensor] | None:
    """The family's `FamilySpec.preprocess` as a plain callable (a function set on the class is not bound)."""
    found = inspect.getattr_static(family, "preprocess", None)
    return found.__func__ if isinstance(found, staticmethod) else found


def preprocess_name(family: FamilySpec) -> str | None:
    """``module:qualname`` of the family's own preprocessing (None without one): what the spec records."""
    found = preprocess_of(family)
    if found is None:
        return None
    named = found if hasattr(found, "__qualname__") else type(found)  # a transform object: its class
    return f"{named.__module__}:{named.__qualname__}"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a model directory, with a ConfigError that names the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"missing {path}") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return data
