"""HunyuanVideo 1.5 caches against musubi-tuner's own caching code: a latentforge build (``--recipe hv15-musubi``,
the tiny hv15 model, real clips, a ``folder:`` source) beside musubi's ``hv_1_5_cache_latents.encode_and_save_batch``
and ``hv_1_5_cache_text_encoder_outputs.encode_and_save_batch`` run on the same frames, captions and weights, writing
their own files. Per file: the key sets, the metadata (latentforge's marks aside) and each tensor's largest absolute
difference, per compute dtype and with / without tiling.

musubi-tuner is not on PyPI: give a checkout's ``src`` (kohya-ss/musubi-tuner; read at commit
30c658c4f4b0bf05038b3346eff9670259b10fc7) and put its imports on the path (it needs ``voluptuous`` and ``einops``
beyond latentforge's own dependencies):

    PYTHONPATH=.:/path/to/deps python bench/hv15_musubi_parity.py --musubi-src /path/to/musubi-tuner/src

Its VAE is its own class (``AutoencoderKLConv3D``, the Tencent layout) built at the tiny config and loaded from the
tiny diffusers VAE's weights with diffusers' key conversion reversed; its Qwen2.5-VL is
``Qwen2_5_VLForConditionalGeneration`` (a tiny vision tower, the tiny text model's weights) as musubi loads it, not
the diffusers snapshot's ``Qwen2_5_VLTextModel``; its ByT5 is the snapshot's T5 encoder stack in float16.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from flows.terminal_run import run_build
from infra.config import BuildConfig
from infra.demo.testmedia import real_clip
from infra.demo.tiny_hv15 import TINY_QWEN_CONFIG, TINY_VAE_CONFIG, make_tiny_hv15
from infra.formats.musubi import flat_name
from infra.plan import make_spec
from infra.preprocess.prepare import prepare_video

#: (clip, caption): straight and curly quotes, a repeat, and none.
CLIPS = (
    ("bikes", 'Cyclists pass a van; its sign says "STOP" and “停” and "STOP" again.'),
    ("carphone", "A man talks on the phone in a car."),
)
GEOMETRY = {"frames": 9, "width": 192, "height": 144}  # buckets over 128 px: musubi's tiling runs


def _source(root: Path) -> Path:
    (root / "clips").mkdir(parents=True)
    for name, caption in CLIPS:
        shutil.copy(real_clip(name), root / "clips" / f"{name}.mp4")
        (root / "clips" / f"{name}.txt").write_text(caption, encoding="utf-8")
    return root


def _config(src: Path, model: Path, out: Path, dtype: str, tiling: bool, mode: str) -> BuildConfig:
    return BuildConfig(
        mode=mode,
        source=f"folder:{src}",
        model=str(model),
        out=str(out),
        recipe="hv15-musubi",
        device="cpu",
        dtype=dtype,
        vae_tiling=tiling,
        decode_samples=0,
        on_conflict="abort",
        on_stale="abort",
        on_loss="accept",
        **GEOMETRY,
    )


def _original_vae_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' ``convert_hunyuan_video_15_vae_checkpoint_to_diffusers`` reversed (the Tencent layout's names)."""
    rules = (
        (r"\.down_blocks\.(\d+)\.resnets\.(\d+)\.", r".down.\1.block.\2."),
        (r"\.down_blocks\.(\d+)\.downsamplers\.0\.", r".down.\1.downsample."),
        (r"\.up_blocks\.(\d+)\.resnets\.(\d+)\.", r".up.\1.block.\2."),
        (r"\.up_blocks\.(\d+)\.upsamplers\.0\.", r".up.\1.upsample."),
        (r"\.mid_block\.resnets\.0\.", ".mid.block_1."),
        (r"\.mid_block\.resnets\.1\.", ".mid.block_2."),
        (r"\.mid_block\.attentions\.0\.to_([qkv])\.", r".mid.attn_1.\1."),
        (r"\.mid_block\.attentions\.0\.", ".mid.attn_1."),
    )
    out = {}
    for key, value in state.items():
        for pattern, replacement in rules:
            key = re.sub(pattern, replacement, key)
        out[key] = value
    return out


def _musubi_vae(vae_module: types.ModuleType, model: Path, dtype: torch.dtype, tiling: bool) -> torch.nn.Module:
    cfg = TINY_VAE_CONFIG
    vae = vae_module.AutoencoderKLConv3D(
        in_channels=3,
        out_channels=3,
        latent_channels=cfg["latent_channels"],
        block_out_channels=cfg["block_out_channels"],
        layers_per_block=cfg["layers_per_block"],
        ffactor_spatial=16,
        ffactor_temporal=4,
        sample_size=128,  # hv_1_5_cache_latents.py's --vae_sample_size default
        sample_tsize=64,
        scaling_factor=vae_module.VAE_SCALING_FACTOR,
    )
    vae.load_state_dict(_original_vae_keys(load_file(model / "vae" / "diffusion_pytorch_model.safetensors")))
    vae.to(dtype=dtype).eval()
    if tiling:
        vae.enable_tiling()
    return vae


def _musubi_text(model: Path, dtype: torch.dtype) -> tuple:
    from transformers import (  # noqa: PLC0415 - bench only
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        T5EncoderModel,
    )

    tokenizer = AutoTokenizer.from_pretrained(model / "tokenizer")
    text = json.loads((model / "text_encoder" / "config.json").read_text())
    vision = {"depth": 1, "hidden_size": 32, "out_hidden_size": TINY_QWEN_CONFIG["hidden_size"], "num_heads": 2}
    vision |= {"intermediate_size": 64, "fullatt_block_indexes": [0]}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    vlm = Qwen2_5_VLForConditionalGeneration(config)
    vlm.model.language_model.load_state_dict(load_file(model / "text_encoder" / "model.safetensors"))
    vlm = vlm.to(dtype).eval()
    byt5 = T5EncoderModel.from_pretrained(model / "text_encoder_2", torch_dtype=torch.float16).encoder.eval()
    return tokenizer, vlm, AutoTokenizer.from_pretrained(model / "tokenizer_2"), byt5


def _compare(ours: Path, theirs: Path) -> dict:
    """Keys (their dtype names aside), metadata (latentforge's marks aside) and, per tensor, the largest absolute
    difference and whether musubi's tensor cast to latentforge's stored dtype equals it bit for bit."""
    with safe_open(str(ours), "pt") as a, safe_open(str(theirs), "pt") as b:
        meta_a = {k: v for k, v in a.metadata().items() if not k.startswith("latentforge_")}
        mine = {k.rsplit("_", 1)[0]: k for k in a.keys()}  # noqa: SIM118 - a safe_open handle has keys() only
        other = {k.rsplit("_", 1)[0]: k for k in b.keys()}  # noqa: SIM118
        row: dict = {"file": ours.name, "metadata_equal": meta_a == b.metadata(), "same_keys": set(mine) == set(other)}
        for base in sorted(set(mine) & set(other)):
            x, y = a.get_tensor(mine[base]), b.get_tensor(other[base])
            row[base] = {
                "keys": [mine[base], other[base]],
                "shape": list(x.shape) if x.shape == y.shape else [list(x.shape), list(y.shape)],
                "max_abs": (x.float() - y.float()).abs().max().item() if x.shape == y.shape and x.numel() else 0.0,
                "max_abs_ref": y.float().abs().max().item() if y.numel() else 0.0,
                "equal_in_stored_dtype": x.shape == y.shape and torch.equal(x, y.to(x.dtype)),
            }
            if x.shape == y.shape and x.numel():
                diff = x.float() - y.float()
                row[base]["relative_l2"] = (diff.norm() / y.float().norm()).item()
                row[base]["differ_in_stored_dtype"] = f"{int((x != y.to(x.dtype)).sum())} of {x.numel()}"
    return row


def _musubi_siglip(model: Path, framepack_utils: types.ModuleType) -> tuple:
    """framepack_utils.load_image_encoders' pair: its fixed processor, the encoder in float16 (from the directory)."""
    from transformers import SiglipImageProcessor, SiglipVisionModel  # noqa: PLC0415 - bench only

    encoder = SiglipVisionModel.from_pretrained(model, subfolder="image_encoder", torch_dtype=torch.float16).eval()
    return SiglipImageProcessor(**framepack_utils.FEATURE_EXTRACTOR_CONFIG), encoder


def run(musubi_src: Path, dtype: str, tiling: bool, mode: str, work: Path, model: Path, src: Path) -> list[dict]:
    sys.path.insert(0, str(musubi_src))
    import musubi_tuner.hv_1_5_cache_latents as cache_latents  # noqa: PLC0415 - given on the command line
    import musubi_tuner.hv_1_5_cache_text_encoder_outputs as cache_text  # noqa: PLC0415
    from musubi_tuner.dataset.image_video_dataset import BaseDataset, ItemInfo  # noqa: PLC0415
    from musubi_tuner.frame_pack import framepack_utils  # noqa: PLC0415
    from musubi_tuner.hunyuan_video_1_5 import hunyuan_video_1_5_vae as vae_module  # noqa: PLC0415

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    out, theirs = work / f"out-{dtype}-{tiling}-{mode}", work / f"musubi-{dtype}-{tiling}-{mode}"
    theirs.mkdir()
    config = _config(src, model, out, dtype, tiling, mode)
    image_assets = _musubi_siglip(model, framepack_utils) if mode == "i2v" else None
    ok, result = run_build(config)
    assert ok and result["done"] == len(CLIPS), result
    spec = make_spec(config)[1].model_copy(update={"dtype": "fp32"})  # uint8 levels: the fp32 scaling is exact
    dataset = types.SimpleNamespace(cache_directory=str(theirs), architecture="hv15")
    vae = _musubi_vae(vae_module, model, torch_dtype, tiling)
    tokenizer, vlm, byt5_tokenizer, byt5 = _musubi_text(model, torch_dtype)
    rows = []
    for name, caption in CLIPS:
        pixels = prepare_video(real_clip(name).read_bytes(), spec).pixels[0]  # (3, F, H, W)
        frames = ((pixels.permute(1, 2, 3, 0) + 1) * 127.5).round().to(torch.uint8).numpy()
        f, h, w = frames.shape[:3]
        key = flat_name(f"clips/{name}")
        item = ItemInfo(f"{key}_00000-{f:03d}", caption, (w, h), frame_count=f, content=np.ascontiguousarray(frames))
        item.latent_cache_path = BaseDataset.get_latent_cache_path(dataset, item)
        cache_latents.encode_and_save_batch(vae, image_assets, [item], i2v=mode == "i2v")
        text_item = ItemInfo(key, caption, (w, h))
        text_item.text_encoder_output_cache_path = BaseDataset.get_text_encoder_output_cache_path(dataset, text_item)
        cache_text.encode_and_save_batch(tokenizer, vlm, byt5_tokenizer, byt5, [text_item], torch.device("cpu"), None)
        for path in (Path(item.latent_cache_path), Path(text_item.text_encoder_output_cache_path)):
            rows.append({"dtype": dtype, "tiling": tiling, "mode": mode, **_compare(out / path.name, path)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--musubi-src", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, src = make_tiny_hv15(work / "model", variant="i2v"), _source(work / "src")
        rows = []
        for dtype, tiling, mode in (("fp32", False, "t2v"), ("fp32", True, "i2v"), ("bf16", True, "i2v")):
            rows += run(args.musubi_src, dtype, tiling, mode, work, model, src)
    print(json.dumps(rows, indent=1))
    print(table(rows))


def table(rows: list[dict]) -> str:
    """A markdown table: per dtype, tiling and tensor, the largest differences over the files."""
    lines = ["| dtype | tiling | mode | tensor | max abs diff (max abs value) | relative L2 | differ in stored dtype |"]
    lines.append("|---|---|---|---|---|---|---|")
    for row in rows:
        for base, cell in row.items():
            if isinstance(cell, dict) and "max_abs" in cell:
                ref, rel = f"{cell['max_abs_ref']:.3g}", cell.get("relative_l2", 0.0)
                differ = cell.get("differ_in_stored_dtype", "0 of 0")
                line = f"| {row['dtype']} | {row['tiling']} | {row['mode']} | {base} {cell['shape']} |"
                line += f" {cell['max_abs']:.3g} ({ref}) |"
                lines.append(f"{line} {rel:.2e} | {differ} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
