"""Throughput benchmark: latentforge against a plain straight-line loop of the recipe, same clips, same tiny model.

Workload: real clips from the test-media cache (`infra.demo.testmedia`: 23 to 250 frames, 176×144 to 1920×1080;
one in four is the 1080p one), cycled into VBVR samples whose prompts repeat within a task family (a few unique
prompts), at 33×128² (fp32, CPU; ``--size 256``, ``--size 832``: the default geometry, 33×832²). ``--decode-pool``
and ``--decode-workers`` are handed to the build (and to its decode-only bound).

Each run is a fresh process. Two rates are reported: the steady state (samples/s from the first sample file written
to the last, as a long run sees it; the start-up before the first printed apart) and the whole process (start-up
included). Peak memory is the whole tree's (`bench.treemem`: the PSS of the command and every process it starts,
the Prefect server included, sampled every 0.1 s); ``wait4``'s peak RSS (the largest single process) is printed
beside it:

* plain: read each sample from the tar, decode every frame (PyAV), stack, ``linspace(0, T-1, 33).round()``,
  ``/127.5-1``, bilinear (align_corners=False), VAE posterior mode, ``(z-mean)/std``, bf16; UMT5 padded to 512 for
  every sample; ``torch.save`` one file per sample;
* latentforge: ``latentforge build`` (every gate; decode-and-verify off, as the plain loop has none), on the
  embedded Prefect API. ``--home reused`` (the default, as a user's ``~/.prefect``) gives every run one Prefect home
  whose database is migrated once before the timed runs (``prefect server database upgrade``: a one-time set-up,
  like the install); ``--home fresh`` gives each run a new one (the first run on a machine: migrations included).

They alternate, ``--repeats`` times each; the medians and their ratios are printed with the issue's targets (PASS /
MISS). The pipeline's two bounds are measured in the same run, in a fresh process after them, on the same samples:

* decode-only: each sample read from the tar and prepared (PyAV decode, 33-frame sampling, resize) on the build's
  decoders (``--decode-pool``, ``--decode-workers``, at most ``prefetch`` + workers in flight), pixels back in
  this process; no encoder. The decoders are started and warmed on a few samples first (untimed).
* encode-only: those samples' pixels already in memory, encoded as the build encodes them (`infra.preprocess.encode`:
  the VAE and the text encoder with its prompt cache; no read, no decode, no write); the first encode untimed.

The steady state's target is within 10% of the slower bound: the encoder hidden behind decoding, or decoding behind
the encoder. (On one CPU host both bounds use the same cores, so it measures how well they share them.)

``--stand-in SECONDS``: both sides encode with the stand-in accelerator of `bench/feed_bench.py` instead
(``bench.feed_family``: a fixed latency per clip with the GIL released, then the pixels average-pooled; no text): the
plain loop sleeps that long per sample where it called the VAE and UMT5, the build runs with ``--family
bench.feed_family:FeedFamily``. The CPU is then left to decoding, as on a GPU host, and the ratios are what a run
whose accelerator takes that long per clip would see (the model's own memory, on the device there, is not in them).

Also: peak memory of preparing one 1080p clip's pixels, whole-tensor (before) and in chunks (after), and bytes per
sample, padded and trimmed text, at the real dims (48×9×52×52 latents, 512×4096 text, bf16; 200-token prompts).

    python bench/throughput_bench.py            # quick: 8 clips, 2 runs each (a few minutes on 2 cores)
    python bench/throughput_bench.py --clips 28 --repeats 3
    python bench/throughput_bench.py --size 832 --clips 6 --repeats 1   # the default geometry (~10 min here)
    python bench/throughput_bench.py --size 832 --stand-in 0.5 --decode-workers 2   # an accelerator of 0.5 s a clip
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.treemem import TreeMemory  # noqa: E402

CLIP_NAMES = ("bigbuckbunny", "bikes", "carphone", "sample_1080p")
GENERATORS = ("G-11_handle_object_reappearance_data-generator", "O-21_ball_trajectory_data-generator")
PROMPTS_PER_GROUP = 2
FRAMES, SIZE = 33, 128
#: The real dims: Wan2.2 latents of 33×832² ([48, 9, 52, 52]) and UMT5-XXL text ([512, 4096]), bf16.
REAL_LATENTS, REAL_TEXT, REAL_PROMPT_TOKENS = (48, 9, 52, 52), (512, 4096), 200
#: ``--stand-in``'s family: the stand-in accelerator of `bench/feed_bench.py`.
STAND_IN_FAMILY = "bench.feed_family:FeedFamily"
TEXT_WORK = re.compile(r"^text +(\d+) prompt\(s\) encoded in (\d+) text-encoder call", re.MULTILINE)

logger = logging.getLogger("throughput_bench")


def make_workload(root: Path, clips: int) -> tuple[Path, Path, int]:
    """(source dir, tiny model dir, unique prompts): `clips` samples over two task families."""
    from infra.demo.data import DemoSample, write_vbvr_tar  # noqa: PLC0415
    from infra.demo.testmedia import real_clip  # noqa: PLC0415
    from infra.demo.tiny import make_tiny_wan22  # noqa: PLC0415

    data = [real_clip(name).read_bytes() for name in CLIP_NAMES]
    samples, prompts = [], set()
    for i in range(clips):
        group = i % 2
        prompt = f"task {group}: the object moves and comes back (template {i // 2 % PROMPTS_PER_GROUP})"
        prompts.add(prompt)
        generator = GENERATORS[group]
        task = generator.split("_", 1)[1].removesuffix("_data-generator")
        files = {"ground_truth.mp4": data[i % len(data)], "prompt.txt": prompt.encode()}
        samples.append(DemoSample(generator=generator, task=task, index=i, files=files))
    src = root / "src"
    src.mkdir(parents=True)
    write_vbvr_tar(src / "bench_part-00000.tar", samples)
    return src, make_tiny_wan22(root / "model", seed=0), len(prompts)


# ----------------------------------------------------------------------------- the children


def plain_loop(src: Path, model: Path, out: Path, size: int, stand_in: bool = False) -> dict:
    """The recipe as a straight script: everything decoded, every prompt encoded (`stand_in`: `model` is the stand-in
    accelerator's, and its encoder, ``bench.feed_family``'s, takes the place of the VAE and the text encoder)."""
    import av  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    out.mkdir(parents=True)
    encode = _stand_in_encoder(model) if stand_in else _plain_encoder(model)
    calls = samples = 0
    for tar_path in sorted(src.glob("*.tar")):
        with tarfile.open(tar_path) as tf:
            members = {m.name: m for m in tf.getmembers() if m.isfile()}
            for name in sorted(n for n in members if n.endswith("ground_truth.mp4")):
                video = tf.extractfile(members[name]).read()
                prompt = tf.extractfile(members[name.replace("ground_truth.mp4", "prompt.txt")]).read().decode()
                with av.open(io.BytesIO(video)) as container:
                    frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
                idx = np.linspace(0, len(frames) - 1, FRAMES).round().astype(np.int64)
                x = torch.from_numpy(frames[idx]).float() / 127.5 - 1.0
                x = F.interpolate(x.permute(0, 3, 1, 2), size=(size, size), mode="bilinear", align_corners=False)
                pixels = x.permute(1, 0, 2, 3).unsqueeze(0).contiguous()
                record, called = encode(pixels, prompt)
                torch.save(record, out / f"{samples:06d}.pt")
                samples, calls = samples + 1, calls + called
    return {"samples": samples, "text_calls": calls, "prompts_encoded": calls}


def _plain_encoder(model: Path) -> Callable[[Any, str], tuple[dict, int]]:
    """The recipe's encode of one sample: VAE posterior mode, ``(z-mean)/std``, bf16; UMT5 padded to 512."""
    import torch  # noqa: PLC0415
    from diffusers import AutoencoderKLWan  # noqa: PLC0415
    from transformers import AutoTokenizer, UMT5EncoderModel  # noqa: PLC0415

    vae = AutoencoderKLWan.from_pretrained(model / "vae", torch_dtype=torch.float32).eval()
    text_encoder = UMT5EncoderModel.from_pretrained(model / "text_encoder", torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model / "tokenizer")
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)

    def encode(pixels: torch.Tensor, prompt: str) -> tuple[dict, int]:
        with torch.inference_mode():
            z = vae.encode(pixels).latent_dist.mode()
            latents = ((z - mean) / std).to(torch.bfloat16)[0]
            tokens = tokenizer([prompt], padding="max_length", max_length=512, truncation=True, return_tensors="pt")
            embeds = text_encoder(tokens.input_ids, tokens.attention_mask).last_hidden_state[0]
        return {"x0": latents, "text_embeds": embeds.to(torch.bfloat16), "prompt": prompt}, 1

    return encode


def _stand_in_encoder(model: Path) -> Callable[[Any, str], tuple[dict, int]]:
    """The build's stand-in encoder itself (`bench.feed_family.FeedEncoder`, its latency in `model`), called per clip
    as the plain loop calls the VAE (no text: that family stores none)."""
    import torch  # noqa: PLC0415

    from bench.feed_family import FeedEncoder  # noqa: PLC0415 - the stand-in only

    encoder = FeedEncoder(model)

    def encode(pixels: torch.Tensor, prompt: str) -> tuple[dict, int]:
        return {"x0": encoder.encode_video(pixels).to(torch.bfloat16), "prompt": prompt}, 0

    return encode


def build_flags(src: Path, model: Path, out: Path, opts: dict) -> list[str]:
    """The build's flags (its decode-only bound is planned from the same)."""
    flags = ["--source", f"vbvr:{src}", "--model", str(model), "--out", str(out), "--frames", str(FRAMES)]
    flags += ["--height", str(opts["size"]), "--width", str(opts["size"]), "--device", "cpu", "--dtype", "fp32"]
    flags += ["--decode-pool", opts["decode_pool"], "--decode-workers", str(opts["decode_workers"])]
    if opts.get("stand_in") is not None:
        flags += ["--family", STAND_IN_FAMILY]
    return [*flags, "--decode-samples", "0", "--on-loss", "accept", "--on-conflict", "abort"]


def latentforge_build(src: Path, model: Path, out: Path, report: Path, opts: dict) -> None:
    """`latentforge build`, in this process, as its console entry point runs it (`flows.cli.main`, which ends the
    process); the report is written by an exit handler (its text-encoder work is read from the summary it prints,
    `text_work`)."""
    import atexit  # noqa: PLC0415

    from flows import cli  # noqa: PLC0415

    def write_report() -> None:
        report.write_text(json.dumps({"samples": len(list(out.rglob("*.pt")))}))

    sys.argv = ["latentforge", "build", *build_flags(src, model, out, opts)]
    atexit.register(write_report)  # first registered: runs after the build's own exit handlers
    cli.main()


def bounds(src: Path, model: Path, out: Path, opts: dict) -> dict:
    """The pipeline's two bounds on the workload's samples: decode-only clips/s on the build's decoders, then
    encode-only samples/s over those pixels (module docstring)."""
    from collections import deque  # noqa: PLC0415 - the bounds' child only

    from infra.config import BuildConfig  # noqa: PLC0415 - the pipeline, in the bounds' child only
    from infra.plan import make_plan  # noqa: PLC0415 - the pipeline, in the bounds' child only
    from infra.preprocess.decoders import decoders  # noqa: PLC0415 - the pipeline, in the bounds' child only
    from infra.preprocess.encode import encode, load_encoder, shard_state  # noqa: PLC0415 - the pipeline
    from infra.preprocess.read import read  # noqa: PLC0415 - the pipeline
    from infra.preprocess.state import RunState  # noqa: PLC0415 - the pipeline
    from infra.sources import open_source  # noqa: PLC0415 - the pipeline

    size, kind, workers = opts["size"], opts["decode_pool"], opts["decode_workers"]
    family = {"family": STAND_IN_FAMILY} if opts.get("stand_in") is not None else {}
    cfg = BuildConfig(source=f"vbvr:{src}", model=str(model), out=str(out), frames=FRAMES, height=size, width=size,
                      device="cpu", dtype="fp32", decode_pool=kind, decode_workers=workers, **family)  # fmt: skip
    plan = make_plan(cfg)
    pool = decoders(kind, workers, plan.job)
    in_flight = cfg.run.prefetch + workers

    def decode_pass(count: int) -> list:
        refs = (ref for shard in plan.shards for ref in open_source(cfg.source).samples(shard.shard))
        flying, done = deque(), []
        for ref in itertools.islice(refs, count):
            if len(flying) >= in_flight:
                done.append(flying.popleft().result())
            flying.append(pool.submit(read(ref)))
        return done + [f.result() for f in flying]

    try:
        decode_pass(min(len(CLIP_NAMES), sum(s.samples for s in plan.shards)))  # started and warmed, untimed
        start = time.perf_counter()
        prepared = decode_pass(sum(s.samples for s in plan.shards))
        decode_s = time.perf_counter() - start
    finally:
        pool.shutdown()
    encoder, state = load_encoder(plan.job), shard_state(plan.job, RunState("bounds"))
    encode(prepared[0], plan.job, encoder, state)  # untimed: the first call's allocations (its prompt is encoded again)
    state = shard_state(plan.job, RunState("bounds"))  # an empty prompt cache: every unique prompt encoded once
    start = time.perf_counter()
    for sample in prepared:
        encode(sample, plan.job, encoder, state)
    encode_s = time.perf_counter() - start
    return {"samples": len(prepared), "decode_rate": len(prepared) / decode_s, "encode_rate": len(prepared) / encode_s}


def child(which: str, src: Path, model: Path, out: Path, report: Path, opts: dict) -> None:
    if which == "plain":
        report.write_text(json.dumps(plain_loop(src, model, out, opts["size"], opts.get("stand_in") is not None)))
    elif which == "bounds":
        report.write_text(json.dumps(bounds(src, model, out, opts)))
    else:
        latentforge_build(src, model, out, report, opts)


def migrated_home(home: Path) -> Path:
    """`home` with its Prefect database migrated (untimed: a one-time set-up of a Prefect home)."""
    home.mkdir(parents=True, exist_ok=True)
    prefect = str(Path(sys.executable).with_name("prefect"))
    env = {**os.environ, "PREFECT_HOME": str(home)}
    subprocess.run([prefect, "server", "database", "upgrade", "-y"], env=env, check=True, capture_output=True)
    return home


def text_work(printed: str) -> dict[str, int]:
    """The text-encoder work a build's summary printed (``text  N prompt(s) encoded in M text-encoder call(s)``)."""
    found = TEXT_WORK.search(printed)
    if found is None:
        return {"text_calls": 0, "prompts_encoded": 0}
    return {"text_calls": int(found.group(2)), "prompts_encoded": int(found.group(1))}


def run_child(which: str, src: Path, model: Path, out: Path, opts: dict, home: Path | None = None) -> dict:
    """One fresh process: its result, wall seconds (start-up included) and peak RSS (bytes). `home`: the Prefect
    home to use (a new one when None)."""
    report = out.with_suffix(".json")
    cmd = [sys.executable, __file__, "--child", which, str(src), str(model), str(out), str(report), json.dumps(opts)]
    env = {**os.environ, "PREFECT_HOME": str(home or out.parent / f"prefect-{out.name}")}
    env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # a busy 2-core machine
    start, started_at = time.perf_counter(), time.time()
    log = out.with_suffix(".log")
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=err, stderr=subprocess.STDOUT)
        with TreeMemory(proc.pid) as tree:
            _, status, usage = os.wait4(proc.pid, 0)
    stderr = log.read_text(errors="replace")
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or not report.exists():
        errors = [line for line in stderr.splitlines() if line.startswith(("error", "ERROR", "Error"))]
        raise RuntimeError(f"{which} failed ({proc.returncode}): {errors[-5:]}\n{stderr[-2000:]}")
    result = json.loads(report.read_text())
    if which == "latentforge":
        result.update(text_work(stderr))
    peaks = {"peak_rss": usage.ru_maxrss * 1024, "peak_tree": tree.peak}
    logger.info("%s at its peak: %s", which, {k: f"{v / 2**20:.0f} MiB" for k, v in tree.at_peak.items()})
    return {**result, **peaks, **steady_state(out, started_at), "seconds": seconds, "rate": result["samples"] / seconds}


def steady_state(out: Path, started_at: float) -> dict:
    """The rate between the first and the last sample file written (their mtimes), and the start-up before the
    first: a run of 10^5 samples sees the first; a run of a few samples is dominated by the second."""
    times = sorted(path.stat().st_mtime for path in out.rglob("*.pt"))
    if len(times) < 2 or times[-1] <= times[0]:
        return {"steady": float("nan"), "startup": float("nan")}
    return {"steady": (len(times) - 1) / (times[-1] - times[0]), "startup": times[0] - started_at}


# ----------------------------------------------------------------------------- pixels and bytes


def pixel_peak(which: str) -> int:
    """Peak RSS growth (bytes) of preparing the 1080p clip's 33 frames at 128² in a fresh process: the kernel's
    high-water mark, reset just before (``/proc/self/clear_refs`` 5, Linux), less the RSS then. (``ru_maxrss``
    cannot be reset: the imports' own transient peak hid growths below it.)"""
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "import numpy as np, torch, torch.nn.functional as F\n"
        "from infra.demo.testmedia import real_clip\n"
        "from infra.media.video import PixelTarget, resize_pixels, sample_frames\n"
        "def kib(key): return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(key + ':'))\n"
        "data = real_clip('sample_1080p').read_bytes(); sample_frames(real_clip('carphone').read_bytes(), 2)\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "base = kib('VmRSS')\n"
        f"if {which!r} == 'streamed':\n"
        "    x = sample_frames(data, 33, target=PixelTarget(128, 128)).pixels\n"
        "else:\n"
        "    frames = sample_frames(data, 33).frames\n"
        f"if {which!r} == 'whole':\n"
        "    x = torch.from_numpy(frames).float() / 127.5 - 1.0\n"
        "    x = F.interpolate(x.permute(0, 3, 1, 2), size=(128, 128), mode='bilinear', align_corners=False)\n"
        "    x = x.permute(1, 0, 2, 3).unsqueeze(0).contiguous()\n"
        f"elif {which!r} == 'chunked':\n"
        "    x = resize_pixels(frames, 128, 128, 'stretch')\n"
        "print((kib('VmHWM') - base) * 1024)\n"
    )
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def bytes_per_sample() -> dict[str, int]:
    """pt file bytes at the real dims: padded text, trimmed text (a 200-token prompt), and the text tensors alone."""
    import torch  # noqa: PLC0415

    from infra.formats import EncodedSample  # noqa: PLC0415
    from infra.formats.pt import serialize  # noqa: PLC0415
    from infra.formats.textpad import trim  # noqa: PLC0415

    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(REAL_LATENTS, generator=gen).to(torch.bfloat16)
    text = torch.zeros(REAL_TEXT, dtype=torch.bfloat16)
    text[:REAL_PROMPT_TOKENS] = torch.randn(REAL_PROMPT_TOKENS, REAL_TEXT[1], generator=gen).to(torch.bfloat16)

    def size(embeds: torch.Tensor) -> int:
        sample = EncodedSample(
            "id", "group", "group/id", "a prompt", latents, embeds, REAL_PROMPT_TOKENS, [121, 1080, 1920, 3], "0" * 64
        )
        return len(serialize(sample))

    trimmed = trim(text, REAL_PROMPT_TOKENS)
    return {
        "padded": size(text),
        "trimmed": size(trimmed),
        "text_padded": text.numel() * 2,
        "text_trimmed": trimmed.numel() * 2,
    }


# ----------------------------------------------------------------------------- main


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", type=int, default=8, help="samples in the workload (28: the issue's)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, alternating")
    parser.add_argument(
        "--home", choices=("reused", "fresh"), default="reused", help="one migrated Prefect home, or a new one per run"
    )
    parser.add_argument("--size", type=int, default=SIZE, help="height and width (832: the default geometry)")
    parser.add_argument("--decode-pool", choices=("thread", "process"), default="thread")
    parser.add_argument("--decode-workers", type=int, default=1)
    parser.add_argument(
        "--stand-in", type=float, metavar="SECONDS", help="encode with the stand-in accelerator (bench.feed_family) of "
        "this latency per clip, in both the plain loop and the build, instead of the tiny model on the CPU"
    )  # fmt: skip
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        which, *paths, opts = args.child
        child(which, *(Path(p) for p in paths), json.loads(opts))
        return
    opts = {"size": args.size, "decode_pool": args.decode_pool, "decode_workers": args.decode_workers,
            "stand_in": args.stand_in}  # fmt: skip
    logging.basicConfig(level=logging.WARNING)
    logger.setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="lf-throughput-") as tmp:
        root = Path(tmp)
        src, model, unique = make_workload(root, args.clips)
        if args.stand_in is not None:
            from bench.feed_family import make_model  # noqa: PLC0415 - the stand-in only

            model = make_model(root / "stand-in", args.stand_in, root / "busy.log")
        home = migrated_home(root / "prefect-home") if args.home == "reused" else None
        runs: dict[str, list[dict]] = {"plain": [], "latentforge": []}
        for attempt in range(args.repeats):
            for which in ("plain", "latentforge"):
                result = run_child(which, src, model, root / f"{which}-{attempt}", opts, home)
                runs[which].append(result)
                print(f"{which:12s} run {attempt}: {result['samples']} samples in {result['seconds']:.1f} s "
                      f"(first sample at {result['startup']:.1f} s, then {result['steady']:.3f} samples/s), "
                      f"peak RSS {result['peak_rss'] / 2**20:.0f} MiB (one process), whole tree "
                      f"{result['peak_tree'] / 2**20:.0f} MiB, "
                      f"text calls {result['text_calls']}")  # fmt: skip
        bound = run_child("bounds", src, model, root / "bounds", opts, home)
        print(f"bounds: decode-only {bound['decode_rate']:.3f} clips/s, encode-only {bound['encode_rate']:.3f} "
              f"samples/s ({bound['samples']} samples, fresh process, peak whole tree "
              f"{bound['peak_tree'] / 2**20:.0f} MiB)")  # fmt: skip
    keys = ("rate", "steady", "startup", "peak_rss", "peak_tree", "text_calls", "prompts_encoded")
    med = {w: {k: statistics.median(r[k] for r in rs) for k in keys} for w, rs in runs.items()}
    speed = med["latentforge"]["rate"] / med["plain"]["rate"]
    steady = med["latentforge"]["steady"] / med["plain"]["steady"]
    memory = med["latentforge"]["peak_tree"] / med["plain"]["peak_tree"]
    largest = med["latentforge"]["peak_rss"] / med["plain"]["peak_rss"]
    whole, chunked, streamed = pixel_peak("whole"), pixel_peak("chunked"), pixel_peak("streamed")
    sizes = bytes_per_sample()
    text_ratio, sample_ratio = sizes["text_trimmed"] / sizes["text_padded"], sizes["trimmed"] / sizes["padded"]
    encoder = "tiny wan22, fp32 CPU" if args.stand_in is None else f"the stand-in accelerator, {args.stand_in} s a clip"
    print(f"\nworkload: {args.clips} real clips (23-250 frames, up to 1920x1080) at {FRAMES}x{args.size}x{args.size}, "
          f"{encoder}, {unique} unique prompts; decoders: {args.decode_workers} {args.decode_pool}(s); "
          f"medians of {args.repeats} runs each, {args.home} Prefect home; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    for which in ("plain", "latentforge"):
        m = med[which]
        print(f"  {which:12s} steady {m['steady']:.3f} samples/s (first sample at {m['startup']:.1f} s), "
              f"whole process {m['rate']:.3f} samples/s  peak memory {m['peak_tree'] / 2**20:.0f} MiB  "
              f"(largest process {m['peak_rss'] / 2**20:.0f} MiB)  "
              f"text-encoder calls {m['text_calls']:.0f} ({m['prompts_encoded']:.0f} prompts encoded)")  # fmt: skip
    slower = min(bound["decode_rate"], bound["encode_rate"])
    which = "decode-only" if bound["decode_rate"] <= bound["encode_rate"] else "encode-only"
    to_bound = med["latentforge"]["steady"] / slower
    print(f"  bounds: decode-only {bound['decode_rate']:.3f} clips/s, encode-only {bound['encode_rate']:.3f} "
          f"samples/s; steady state {med['latentforge']['steady']:.3f} = {to_bound:.2f}x the slower "
          f"({which}) (target >= 0.90x): {_verdict(to_bound >= 0.9)}")  # fmt: skip
    print(f"  steady-state samples/s ratio {steady:.2f}x (target >= 2x): {_verdict(steady >= 2)}")
    print(f"  whole-process samples/s ratio {speed:.2f}x (start-up included)")
    print(
        f"  peak memory ratio {memory:.2f}x (target <= 0.5x): {_verdict(memory <= 0.5)}  "
        f"(the whole tree's PSS + its /dev/shm files; the largest single process's RSS: {largest:.2f}x)"
    )
    calls, encoded = med["latentforge"]["text_calls"], med["latentforge"]["prompts_encoded"]
    if args.stand_in is None:  # the stand-in stores no text
        print(f"  prompts encoded {encoded:.0f} in {calls:.0f} call(s), unique prompts {unique} (target: calls <= "
              f"unique, each prompt once): {_verdict(calls <= unique and encoded == unique)}")  # fmt: skip
    print(f"pixels of one 1080p clip (33 frames -> 128x128): peak growth whole-tensor {whole / 2**20:.0f} MiB, "
          f"frames kept then chunked {chunked / 2**20:.0f} MiB ({chunked / whole:.2f}x), made while decoding "
          f"{streamed / 2**20:.0f} MiB ({streamed / whole:.2f}x)")  # fmt: skip
    print(f"bytes per sample at the real dims (pt, 48x9x52x52 + 512x4096 bf16, {REAL_PROMPT_TOKENS}-token prompt): "
          f"padded {sizes['padded']:,}, trimmed {sizes['trimmed']:,} ({sample_ratio:.0%}); text alone "
          f"{sizes['text_padded']:,} -> {sizes['text_trimmed']:,} ({text_ratio:.0%}, target <= 45%: "
          f"{_verdict(text_ratio <= 0.45)})")  # fmt: skip


if __name__ == "__main__":
    main()
