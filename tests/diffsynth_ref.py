"""DiffSynth-Studio's own released Wan training data path, run from its wheel on the CPU (tests only).

``pip download --no-deps`` puts ``diffsynth==2.1.12`` and the pure-Python packages its Wan pipeline imports and this
environment lacks (``einops``, ``modelscope``, ``modelscope_hub``) into the test-media cache (`fetch_package`); their
files are extracted beside it and put on ``sys.path``; torchvision's transforms come from its wheel
(`tests.torchvision_ref`). Its own classes then run: ``WanVideoPipeline`` with its units and unit runner, its VAE
(``VideoVAE_`` / ``VideoVAE38_``), UMT5 (``WanTextEncoder``), tokenizer wrapper (``HuggingfaceTokenizer``), CLIP
(``clip_xlm_roberta_vit_h_14``'s vision tower and transforms), ``WanModel`` and ``FlowMatchSFTLoss``, at the tiny
snapshot's sizes with its weights (renamed from diffusers' / transformers' names to DiffSynth's, as the original Wan
checkpoints name them). ``WanTrainingModule.get_pipeline_inputs`` lives in its repository's example script, not in
the package: `pipeline_inputs` restates it (modelscope/DiffSynth-Studio ``examples/wanvideo/model_training/train.py``
at commit fed7b18fac2ed4cb802796eec91970e7659bccde).
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import shutil
import sys
import tempfile
import textwrap
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from PIL import Image
from safetensors.torch import load_file

from infra.demo.testmedia import fetch_package, media_cache_dir
from infra.models.base import read_json
from tests.torchvision_ref import torchvision_transforms

WHEELS = ("diffsynth==2.1.12", "einops==0.8.1", "modelscope==1.40.2", "modelscope_hub==0.5.1")
FOLDER = "diffsynth-2.1.12"
_RESNET = {"norm1": "residual.0", "conv1": "residual.2", "norm2": "residual.3", "conv2": "residual.6"}


def diffsynth_dir() -> Path:
    """The wheels' files, extracted once into the media cache."""
    target = media_cache_dir() / FOLDER
    if (target / "diffsynth" / "version.py").is_file():
        return target
    staging = Path(tempfile.mkdtemp(prefix=".ds-", dir=media_cache_dir()))
    try:
        for requirement in WHEELS:
            with zipfile.ZipFile(fetch_package(requirement)) as wheel:
                wheel.extractall(staging)
        if not target.exists():  # another process may have finished first
            staging.replace(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@functools.cache
def diffsynth() -> SimpleNamespace:
    """DiffSynth's modules used here (imported from the wheel, never from an install)."""
    torchvision_transforms()  # `import torchvision` in its modules finds the wheel's transforms
    sys.path.append(str(diffsynth_dir()))
    import diffsynth.pipelines.wan_video as wan_video  # noqa: PLC0415 - from the wheel, after the path
    from diffsynth.core.data import operators, unified_dataset  # noqa: PLC0415
    from diffsynth.diffusion import loss, training_module  # noqa: PLC0415
    from diffsynth.models import wan_video_image_encoder, wan_video_text_encoder, wan_video_vae  # noqa: PLC0415

    if not Path(wan_video.__file__).is_relative_to(diffsynth_dir()):
        raise ImportError(f"diffsynth came from {wan_video.__file__}, not the {WHEELS[0]} wheel")
    return SimpleNamespace(
        wan_video=wan_video,
        operators=operators,
        unified_dataset=unified_dataset,
        loss=loss,
        training_module=training_module,
        image_encoder=wan_video_image_encoder,
        text_encoder=wan_video_text_encoder,
        vae=wan_video_vae,
    )


def _resnet(tail: str) -> str:
    head, _, rest = tail.partition(".")
    return f"{_RESNET.get(head, 'shortcut' if head == 'conv_shortcut' else head)}.{rest}"


def original_vae_key(key: str, residual: bool, blocks: int) -> str | None:
    """A diffusers AutoencoderKLWan key of the encoder path → the original Wan checkpoint's (DiffSynth's) name."""
    if key.startswith("quant_conv."):
        return "conv1." + key.removeprefix("quant_conv.")
    if not key.startswith("encoder."):
        return None  # the decoder: data_process does not decode
    rest = key.removeprefix("encoder.")
    for old, new in (("conv_in.", "conv1."), ("norm_out.", "head.0."), ("conv_out.", "head.2.")):
        if rest.startswith(old):
            return "encoder." + new + rest.removeprefix(old)
    if m := re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d)\.(.+)", rest):
        index = {("resnets", "0"): 0, ("attentions", "0"): 1, ("resnets", "1"): 2}[(m[1], m[2])]
        return f"encoder.middle.{index}.{m[3] if m[1] == 'attentions' else _resnet(m[3])}"
    if residual and (m := re.fullmatch(r"down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", rest)):
        return f"encoder.downsamples.{m[1]}.downsamples.{m[2]}.{_resnet(m[3])}"
    if residual and (m := re.fullmatch(r"down_blocks\.(\d+)\.downsampler\.(.+)", rest)):
        return f"encoder.downsamples.{m[1]}.downsamples.{blocks}.{m[2]}"
    m = re.fullmatch(r"down_blocks\.(\d+)\.(.+)", rest)
    assert m is not None, key
    return f"encoder.downsamples.{m[1]}.{_resnet(m[2])}"


def vae(snapshot: Path) -> torch.nn.Module:
    """DiffSynth's Wan VAE (``WanVideoVAE``, or ``WanVideoVAE38`` for the TI2V-5B one) with the snapshot's encoder."""
    ds, cfg = diffsynth().vae, read_json(snapshot / "vae" / "config.json")
    residual, blocks = bool(cfg.get("is_residual")), int(cfg["num_res_blocks"])
    state = load_file(snapshot / "vae" / "diffusion_pytorch_model.safetensors")
    mapped = {new: v for k, v in state.items() if (new := original_vae_key(k, residual, blocks)) is not None}
    if residual:  # its 0.7 B-parameter wrapper is not built: the attributes its __init__ sets, from its own source
        tiny = ds.VideoVAE38_(
            dim=cfg["base_dim"], dec_dim=cfg["decoder_base_dim"], z_dim=cfg["z_dim"], num_res_blocks=blocks
        )
        wrapper = ds.WanVideoVAE38.__new__(ds.WanVideoVAE38)
        torch.nn.Module.__init__(wrapper)
        wrapper.mean, wrapper.std = (torch.tensor(v) for v in init_lists(ds.WanVideoVAE38, ("mean", "std")))
        wrapper.scale, wrapper.upsampling_factor, wrapper.z_dim = [wrapper.mean, 1.0 / wrapper.std], 16, cfg["z_dim"]
    else:
        tiny = ds.VideoVAE_(dim=cfg["base_dim"], z_dim=cfg["z_dim"], num_res_blocks=blocks)
        wrapper = ds.WanVideoVAE(z_dim=cfg["z_dim"])
    missing, unexpected = tiny.load_state_dict(mapped, strict=False)
    assert not unexpected and all(k.startswith(("decoder.", "conv2.")) for k in missing), (unexpected, missing)
    wrapper.model = tiny.eval().requires_grad_(False)
    return wrapper


def init_lists(cls: type, names: tuple[str, ...]) -> list[list[float]]:
    """The list literals that `cls.__init__` assigns to `names` (read from its source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    found = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.List)
    }
    return [found[name] for name in names]


def text_encoder(snapshot: Path) -> torch.nn.Module:
    """DiffSynth's ``WanTextEncoder`` at the snapshot's UMT5 sizes, with its weights."""
    cfg = read_json(snapshot / "text_encoder" / "config.json")
    model = diffsynth().text_encoder.WanTextEncoder(
        vocab=cfg["vocab_size"],
        dim=cfg["d_model"],
        dim_attn=cfg["num_heads"] * cfg["d_kv"],
        dim_ffn=cfg["d_ff"],
        num_heads=cfg["num_heads"],
        num_layers=cfg["num_layers"],
        num_buckets=cfg["relative_attention_num_buckets"],
        shared_pos=False,
    )
    state = load_file(snapshot / "text_encoder" / "model.safetensors")
    names = {"SelfAttention.relative_attention_bias": "pos_embedding.embedding", "DenseReluDense.wi_0": "ffn.gate.0"}
    names |= {"DenseReluDense.wi_1": "ffn.fc1", "DenseReluDense.wo": "ffn.fc2", "layer_norm": "norm{}"}
    mapped = {"token_embedding.weight": state["shared.weight"], "norm.weight": state["encoder.final_layer_norm.weight"]}
    for key, value in state.items():
        if m := re.fullmatch(r"encoder\.block\.(\d+)\.layer\.(\d)\.(.+)\.weight", key):
            part = names.get(m[3], m[3].replace("SelfAttention", "attn")).format(int(m[2]) + 1)
            mapped[f"blocks.{m[1]}.{part}.weight"] = value
    model.load_state_dict(mapped, strict=True)
    return model.eval().requires_grad_(False)


def image_encoder(snapshot: Path) -> torch.nn.Module:
    """DiffSynth's ``WanImageEncoder`` around its own CLIP builder at the snapshot's vision sizes (a text tower of one
    small layer, unused), with the snapshot's vision weights. Its ``__init__`` builds the full ViT-H and XLM-R."""
    ds, cfg = diffsynth().image_encoder, read_json(snapshot / "image_encoder" / "config.json")
    model, transforms = ds.clip_xlm_roberta_vit_h_14(
        pretrained=False,
        return_transforms=True,
        return_tokenizer=False,
        vision_dim=cfg["hidden_size"],
        vision_heads=cfg["num_attention_heads"],
        vision_layers=cfg["num_hidden_layers"],
        vision_mlp_ratio=cfg["intermediate_size"] / cfg["hidden_size"],
        vocab_size=64,
        text_dim=32,
        text_heads=2,
        text_layers=1,
    )
    saved = load_file(snapshot / "image_encoder" / "model.safetensors")
    state = {k.removeprefix("vision_model."): v for k, v in saved.items()}  # transformers 5 saves no prefix
    visual = {
        "patch_embedding.weight": state["embeddings.patch_embedding.weight"],
        "cls_embedding": state["embeddings.class_embedding"].view(1, 1, -1),
        "pos_embedding": state["embeddings.position_embedding.weight"].unsqueeze(0),
        "pre_norm.weight": state["pre_layrnorm.weight"],
        "pre_norm.bias": state["pre_layrnorm.bias"],
    }
    for i in range(cfg["num_hidden_layers"]):
        hf = f"encoder.layers.{i}."
        for param in ("weight", "bias"):
            qkv = [state[f"{hf}self_attn.{p}_proj.{param}"] for p in "qkv"]
            visual[f"transformer.{i}.attn.to_qkv.{param}"] = torch.cat(qkv)
            pairs = {"self_attn.out_proj": "attn.proj", "layer_norm1": "norm1", "layer_norm2": "norm2"}
            pairs |= {"mlp.fc1": "mlp.0", "mlp.fc2": "mlp.2"}
            visual |= {
                f"transformer.{i}.{ours}.{param}": state[f"{hf}{theirs}.{param}"] for theirs, ours in pairs.items()
            }
    missing, unexpected = model.visual.load_state_dict(visual, strict=False)
    assert not unexpected and set(missing) <= {"post_norm.weight", "post_norm.bias", "head"}, (missing, unexpected)
    encoder = ds.WanImageEncoder.__new__(ds.WanImageEncoder)
    torch.nn.Module.__init__(encoder)
    encoder.model, encoder.transforms = model.eval().requires_grad_(False), transforms
    return encoder


def tiny_dit(snapshot: Path, *, image: bool, fused: bool) -> torch.nn.Module:
    """A one-block ``WanModel`` taking the snapshot's latents, text width and conditioning (random weights): what its
    training step runs the cached inputs through."""
    channels = int(read_json(snapshot / "vae" / "config.json")["z_dim"])
    text_dim = int(read_json(snapshot / "text_encoder" / "config.json")["d_model"])
    torch.manual_seed(0)
    model = diffsynth().wan_video.WanModel(
        dim=128,  # one head of 128, the real models' head size (its 3-D RoPE splits a head in three)
        in_dim=channels + (20 if image and not fused else 0),  # y beside the latents (TI2V-5B fuses its frame)
        ffn_dim=64,
        out_dim=channels,
        text_dim=text_dim,
        freq_dim=32,
        eps=1e-6,
        patch_size=(1, 2, 2),
        num_heads=1,
        num_layers=1,
        has_image_input=image and (snapshot / "image_encoder").is_dir(),
        seperated_timestep=fused,
        require_vae_embedding=not fused,
        require_clip_embedding=(snapshot / "image_encoder").is_dir(),
        fuse_vae_embedding_in_latents=fused,
    )
    return model.eval()


def pipeline(snapshot: Path, *, image: bool, fused: bool = False) -> Any:
    """DiffSynth's ``WanVideoPipeline`` (CPU, float32) with the snapshot's encoders, switched to training as its
    ``switch_pipe_to_training_mode`` does (the scheduler's training timesteps)."""
    ds = diffsynth()
    pipe = ds.wan_video.WanVideoPipeline(device="cpu", torch_dtype=torch.float32)
    pipe.vae, pipe.text_encoder = vae(snapshot), text_encoder(snapshot)
    pipe.tokenizer = ds.text_encoder.HuggingfaceTokenizer(
        name=str(snapshot / "tokenizer"), seq_len=512, clean="whitespace"
    )
    pipe.image_encoder = image_encoder(snapshot) if (snapshot / "image_encoder").is_dir() else None
    pipe.dit = tiny_dit(snapshot, image=image, fused=fused)
    pipe.scheduler.set_timesteps(1000, training=True)
    return pipe


def pipeline_inputs(frames: list[Image.Image], prompt: str, image: bool) -> tuple[dict, dict, dict]:
    """``WanTrainingModule.get_pipeline_inputs`` (its example script, restated) with ``--extra_inputs input_image``
    where `image`."""
    shared: dict[str, Any] = {
        "input_video": frames,
        "height": frames[0].size[1],
        "width": frames[0].size[0],
        "num_frames": len(frames),
        "cfg_scale": 1,
        "tiled": False,
        "rand_device": "cpu",
        "use_gradient_checkpointing": True,
        "use_gradient_checkpointing_offload": False,
        "cfg_merge": False,
        "vace_scale": 1,
        "max_timestep_boundary": 1.0,
        "min_timestep_boundary": 0.0,
    }
    if image:
        shared["input_image"] = frames[0]
    return shared, {"prompt": prompt}, {}


@torch.no_grad()
def data_process(pipe: Any, frames: list[Image.Image], prompt: str, image: bool) -> tuple[dict, dict, dict]:
    """What its ``--task sft:data_process`` saves for one sample: the units that need no DiT's gradient (its
    ``split_pipeline_units`` for a LoRA on ``dit``), through its unit runner, from the transferred inputs."""
    trainer = diffsynth().training_module.DiffusionTrainingModule()
    inputs = trainer.transfer_data_to_device(pipeline_inputs(frames, prompt, image), pipe.device, pipe.torch_dtype)
    for unit in pipe.split_pipeline_units(["dit"])[1]:
        inputs = pipe.unit_runner(unit, pipe, *inputs)
    return inputs


def train_step(pipe: Any, loaded: tuple[dict, dict, dict]) -> torch.Tensor:
    """Its ``--task sft:train`` step on a loaded file: the inputs transferred, the units that need the DiT, then
    ``FlowMatchSFTLoss`` (noise, the DiT, the loss)."""
    ds = diffsynth()
    trainer = ds.training_module.DiffusionTrainingModule()
    inputs = trainer.transfer_data_to_device(loaded, pipe.device, pipe.torch_dtype)
    for unit in pipe.split_pipeline_units(["dit"])[0]:
        inputs = pipe.unit_runner(unit, pipe, *inputs)
    shared, posi, _ = inputs
    return ds.loss.FlowMatchSFTLoss(pipe, **shared, **posi)


def crop_resize(frames: list[Image.Image], height: int, width: int) -> list[Image.Image]:
    """Its ``ImageCropAndResize`` operator on each frame (what its video loader applies)."""
    operator = diffsynth().operators.ImageCropAndResize(height, width, None, 16, 16)
    return [operator(frame) for frame in frames]
