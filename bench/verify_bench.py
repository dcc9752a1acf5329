"""Decode-and-verify of one sample at real size (33×832², tiny wan22, fp32 CPU), before and after, same run.

Each measurement is a fresh process (peak RSS from ``wait4``, model load and imports included):

* encode: the preprocess's work for the sample: the recipe's pixels (`prepare_video`), then `encode_video`;
* before: decode-and-verify as the baseline commit did it: the VAE's whole decode, whole-tensor uint8 copies for
  the side-by-side mp4 and the PNG strip, the float64 ``conv2d`` SSIM (that commit's own modules, read from git);
* after: this tree: `decode_chunks` streamed into `infra.audit.compare` (scores and one uint8 canvas), mp4, PNG.

Both decode-verify paths re-derive the source pixels and decode the same stored latents; their PSNR/SSIM are
printed side by side. Ratios: each path's seconds over the encode's, and peak RSS over the encode's.

    python bench/decode_bench.py --verify            # ~10 minutes on 2 shared cores
    python bench/verify_bench.py --builds            # the whole process: 3-sample builds, --decode-samples 0 and 1
    python bench/verify_bench.py --chunked main --size 256   # before = the chunked Wan decode at `main` (below)

``--chunked REV`` makes "before" the Wan decode as REV's ``infra/models/wan_decode.py`` ran it (a few latent frames
per decoder call over the VAE's private feature cache, streamed into this tree's `compare`), so the ratio is that
decode against this tree's public ``vae.decode``; ``--size N`` decodes N×N frames instead of 832².

``--builds`` runs two ``latentforge build`` processes at once (3 clips, 33×832², tiny wan22, fp32 CPU), one with
decode-and-verify of one sample and one without, and prints each one's peak RSS (their times overlap: not compared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE_REV = "ef0d6d6"  # main before decode-and-verify was streamed
CLIP, FRAMES, SIZE = "bikes", 33, 832


def _spec(size: int):  # a CacheSpec, imported late (the parent stays light)
    from infra.config import CacheSpec  # noqa: PLC0415

    fields = {"family": "wan22", "model_identity": {}, "format": "pt", "frames": FRAMES, "height": size}
    fields |= {"width": size, "dtype": "fp32", "text_max_length": 8, "text_padding": "raw"}
    return CacheSpec(**fields, temporal="linspace", resize="stretch", latent_norm="x")


def _module_at(rev: str, path: str, name: str) -> types.ModuleType:
    """`path` as it was at `rev`, imported under `name` (the baseline's own code, not a copy)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, check=True).stdout
    module = types.ModuleType(name)
    module.__file__ = f"{rev}:{path}"
    sys.modules[name] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)  # our own repository's code at `rev`
    return module


def _chunked_decode(family, latents, rev: str):
    """`rev`'s chunked Wan decode of `latents`, as `rev`'s ``Wan22Encoder.decode_chunks`` yielded it."""
    old = _module_at(rev, "infra/models/wan_decode.py", "baseline_wan_decode")
    z = (latents.float().unsqueeze(0) * family.std + family.mean).to(family.device, family.dtype)
    for pixels in old.decode_in_chunks(family.vae, z, old.DECODE_CHUNK):
        yield pixels.float().cpu()[0].clamp(-1, 1)


def _child(which: str, work: Path, rev: str, size: int, chunked: bool) -> dict:
    import torch  # noqa: PLC0415

    from infra.demo.testmedia import real_clip  # noqa: PLC0415
    from infra.models import load_family  # noqa: PLC0415
    from infra.preprocess.prepare import prepare_video  # noqa: PLC0415

    family = load_family(work / "model", "wan22", torch.device("cpu"), torch.float32)
    media, spec = real_clip(CLIP).read_bytes(), _spec(size)
    start = time.perf_counter()
    source = prepare_video(media, spec).pixels
    if which == "encode":
        latents = family.encode_video(source)
        torch.save(latents, work / "latents.pt")
        return {"seconds": time.perf_counter() - start}
    latents, source = torch.load(work / "latents.pt", weights_only=True), source[0]
    if which == "before" and chunked:
        from infra.audit.compare import compare  # noqa: PLC0415

        compared = compare(source, _chunked_decode(family, latents, rev))
        del source
        files = [compared.mp4, compared.strip_png()]
        psnr, ssim = compared.score.psnr, compared.score.ssim
    elif which == "before":
        metrics = _module_at(rev, "infra/audit/metrics.py", "baseline_metrics")
        old = _module_at(rev, "infra/audit/decode_verify.py", "baseline_decode_verify")
        decoded = family.decode(latents)
        files = [old.side_by_side_mp4(source, decoded), old.frame_strip_png(source, decoded)]
        psnr, ssim = metrics.psnr(source, decoded), metrics.ssim(source, decoded)
    else:
        from infra.audit.compare import compare  # noqa: PLC0415

        compared = compare(source, family.decode_chunks(latents))
        del source
        files = [compared.mp4, compared.strip_png()]
        psnr, ssim = compared.score.psnr, compared.score.ssim
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "psnr": psnr, "ssim": ssim, "mp4_bytes": len(files[0])}


def _run(which: str, work: Path, rev: str, size: int, chunked: bool) -> dict:
    """One fresh process: its result and its peak RSS."""
    report = work / f"{which}.json"
    args = [sys.executable, __file__, "--child", which, str(work), rev, str(size), str(int(chunked))]
    proc = subprocess.Popen(args, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)})
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{which} failed with status {status}")
    return json.loads(report.read_text()) | {"peak_rss": usage.ru_maxrss * 1024}


def main(rev: str = BASELINE_REV, size: int = SIZE, chunked: bool = False) -> None:
    from infra.demo.tiny import make_tiny_wan22  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="lf-verify-bench-") as tmp:
        work = Path(tmp)
        make_tiny_wan22(work / "model", seed=0)
        enc = _run("encode", work, rev, size, chunked)
        runs = {which: _run(which, work, rev, size, chunked) for which in ("before", "after")}
    threads = os.environ.get("OMP_NUM_THREADS", "default")
    before = f"the chunked Wan decode at {rev}" if chunked else f"decode-and-verify at {rev}"
    where = f"{CLIP}, {FRAMES}x{size}x{size}, tiny wan22, before = {before}, fp32 CPU, OMP_NUM_THREADS={threads}"
    print(f"decode-verify of one sample: {where}")
    print(f"  encode (pixels + VAE encode)  {enc['seconds']:7.1f} s  peak RSS {enc['peak_rss'] / 2**20:6.0f} MiB")
    for which, r in runs.items():
        print(
            f"  {which:<6} decode-verify  {r['seconds']:7.1f} s  peak RSS {r['peak_rss'] / 2**20:6.0f} MiB"
            f"  = {r['seconds'] / enc['seconds']:.2f}x encode time, {r['peak_rss'] / enc['peak_rss']:.2f}x encode peak"
            f"  (PSNR {r['psnr']:.4f} dB, SSIM {r['ssim']:.6f}, mp4 {r['mp4_bytes']:,} B)"
        )
    before, after = runs["before"], runs["after"]
    gaps = {m: abs(after[m] - before[m]) for m in ("psnr", "ssim")}
    print(f"  |after - before|: PSNR {gaps['psnr']:.2e} dB, SSIM {gaps['ssim']:.2e}")
    print(
        f"  after/before: time {after['seconds'] / before['seconds']:.2f}x, peak RSS"
        f" {after['peak_rss'] / before['peak_rss']:.2f}x; targets: <= 2x encode time"
        f" ({'PASS' if after['seconds'] <= 2 * enc['seconds'] else 'MISS'}), peak <= encode's"
        f" ({'PASS' if after['peak_rss'] <= enc['peak_rss'] else 'MISS'})"
    )


def builds() -> None:
    """Peak RSS of whole builds, with and without decode-and-verify of one sample."""
    sys.path.insert(0, str(ROOT / "bench"))
    from throughput_bench import make_workload  # noqa: PLC0415

    lf = Path(sys.executable).with_name("latentforge")
    with tempfile.TemporaryDirectory(prefix="lf-verify-builds-") as tmp:
        src, model, _ = make_workload(Path(tmp), 3)
        procs = {}
        for k in ("0", "1"):
            args = [str(lf), "build", "--source", f"vbvr:{src}", "--model", str(model), "--out", f"{tmp}/out{k}"]
            args += ["--device", "cpu", "--dtype", "fp32", "--decode-samples", k, "--on-loss", "accept"]
            env = os.environ | {"PREFECT_HOME": f"{tmp}/prefect{k}"}
            procs[k] = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for k, proc in procs.items():
            _, status, usage = os.wait4(proc.pid, 0)
            peak = usage.ru_maxrss / 2**20  # KiB → GiB
            where = f"3 samples at {FRAMES}x{SIZE}x{SIZE}"
            print(f"  build, {where}, --decode-samples {k}: exit {status}, peak RSS {peak:.2f} GiB")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--builds"]:
        builds()
    elif sys.argv[1:2] == ["--child"]:
        which, work, rev, size, chunked = sys.argv[2], Path(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
        (work / f"{which}.json").write_text(json.dumps(_child(which, work, rev, int(size), chunked == "1")))
    else:
        parser = argparse.ArgumentParser(description="decode-and-verify of one sample, before and after")
        parser.add_argument("rev", nargs="?", default=BASELINE_REV)
        parser.add_argument("--chunked", metavar="REV", help="before = REV's chunked Wan decode")
        parser.add_argument("--size", type=int, default=SIZE)
        args = parser.parse_args()
        main(args.chunked or args.rev, args.size, args.chunked is not None)
