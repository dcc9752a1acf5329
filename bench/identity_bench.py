"""Model identity at real size: plan time for a full-size Wan2.2 VAE (built from its config, random weights),
first (every byte hashed) and second (remembered per file), against latentforge 0.1's sampled identity
measured in the same run. A Hugging Face cache snapshot (the blob's name is its sha256) is timed too.

Needs ~3 GB of disk and ~4 GB of memory for a minute. Prints seconds and ratios.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan

from infra.models import identity
from infra.models.identity import component_identity
from infra.models.wan_constants import WAN22_VAE_CONFIG


def _timed(label: str, fn) -> float:
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    print(f"{label:<48} {seconds:8.2f} s   ({identity.stats['bytes_hashed'] / 1e9:.2f} GB hashed)")
    identity.stats.update(dict.fromkeys(identity.stats, 0))
    return seconds


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="lf-identity-bench-") as tmp:
        root = Path(tmp)
        os.environ["LATENTFORGE_CACHE_DIR"] = str(root / "cache")
        config = {k: v for k, v in WAN22_VAE_CONFIG.items() if k != "clip_output"}
        torch.manual_seed(0)
        vae = AutoencoderKLWan(**config)
        vae.save_pretrained(root / "vae", safe_serialization=True)
        del vae
        size = sum(p.stat().st_size for p in (root / "vae").iterdir())
        print(f"full-size Wan2.2 VAE: {size / 1e9:.2f} GB of weights")
        sampled = _timed("sampled identity (latentforge 0.1)", lambda: component_identity(root / "vae", "sampled"))
        first = _timed("content identity, first plan (hash every byte)", lambda: component_identity(root / "vae"))
        second = _timed("content identity, second plan (remembered)", lambda: component_identity(root / "vae"))
        blobs = root / "hub" / "blobs"
        blobs.mkdir(parents=True)
        snapshot = root / "hub" / "snapshots" / "rev" / "vae"
        snapshot.mkdir(parents=True)
        for path in (root / "vae").iterdir():
            digest = identity.file_sha256(path)
            shutil.move(path, blobs / digest if path.suffix == ".safetensors" else snapshot / path.name)
            if path.suffix == ".safetensors":
                (snapshot / path.name).symlink_to(os.path.relpath(blobs / digest, snapshot))
        identity.stats.update(dict.fromkeys(identity.stats, 0))
        hub = _timed("content identity, Hub snapshot (blob names)", lambda: component_identity(snapshot))
        ratios = f"first / sampled {first / sampled:6.1f}x   second / first {second / first:6.4f}x"
        print(f"{ratios}   hub / first {hub / first:6.4f}x")


if __name__ == "__main__":
    main()
