"""Real constants of the Wan2.2-TI2V-5B VAE (``Wan-AI/Wan2.2-TI2V-5B-Diffusers``, subfolder ``vae``).

Source: huggingface/diffusers ``scripts/convert_wan_to_diffusers.py``, dict ``vae22_diffusers_config``
(read at commit 7d5682739a1ee5b25bb9f5a81c573ea7e38d8e22). That dict is what ``convert_vae_22()`` passes to
``AutoencoderKLWan(**vae22_diffusers_config)``; every key it does not name falls back to the class default
(the Wan2.1 values). The published ``vae/config.json`` records those defaults explicitly, so
``WAN22_VAE_CONFIG`` below lists them too, marked as inherited.

Caveat: ``clip_output`` is in the script and in the published config.json, but it is not an ``__init__``
parameter of ``AutoencoderKLWan`` in diffusers 0.42 (passing it raises ``TypeError``; ``from_pretrained``
ignores it with a warning). Drop it before calling the constructor.
"""

from __future__ import annotations

from typing import Any

# Per-channel latent statistics (z_dim = 48), verbatim from ``vae22_diffusers_config["latents_mean"]``.
WAN22_LATENTS_MEAN: tuple[float, ...] = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip

# Verbatim from ``vae22_diffusers_config["latents_std"]``.
WAN22_LATENTS_STD: tuple[float, ...] = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip

# Full Wan2.2 VAE config. Keys marked "script" are exactly ``vae22_diffusers_config``; keys marked
# "inherited" are the ``AutoencoderKLWan`` defaults that the script relies on (and that the published
# vae/config.json records). Treat as read-only; copy before modifying.
WAN22_VAE_CONFIG: dict[str, Any] = {
    "base_dim": 160,  # script
    "z_dim": 48,  # script
    "is_residual": True,  # script
    "in_channels": 12,  # script (3 RGB channels x patch_size**2)
    "out_channels": 12,  # script
    "decoder_base_dim": 256,  # script
    "scale_factor_temporal": 4,  # script
    "scale_factor_spatial": 16,  # script
    "patch_size": 2,  # script
    "latents_mean": list(WAN22_LATENTS_MEAN),  # script
    "latents_std": list(WAN22_LATENTS_STD),  # script
    "clip_output": False,  # script; NOT accepted by AutoencoderKLWan.__init__ in diffusers 0.42
    "dim_mult": [1, 2, 4, 4],  # inherited
    "num_res_blocks": 2,  # inherited
    "attn_scales": [],  # inherited
    "temperal_downsample": [False, True, True],  # inherited (upstream spelling)
    "dropout": 0.0,  # inherited
}


# The Wan2.1 VAE (z_dim 16, 8x spatial / 4x temporal), used by Wan2.1 T2V/I2V and Wan2.2 T2V/I2V-A14B. Source: the
# same script at commit 58eb52c0803ea9af3abec60841c2a093bdf1f951: ``convert_vae()`` builds ``AutoencoderKLWan()``
# with no argument, so the published ``vae/config.json`` holds the class defaults of diffusers 0.42.1, listed here.
WAN21_LATENTS_MEAN: tuple[float, ...] = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
WAN21_LATENTS_STD: tuple[float, ...] = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip
WAN21_VAE_CONFIG: dict[str, Any] = {
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "latents_mean": list(WAN21_LATENTS_MEAN),
    "latents_std": list(WAN21_LATENTS_STD),
    "is_residual": False,
    "in_channels": 3,
    "out_channels": 3,
    "patch_size": None,
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 8,
}
