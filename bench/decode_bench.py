"""Decode benchmark: latentforge's frame sampler against the naive recipe, measured in the same run.

Baseline: decode every frame to RGB, keep them all, then pick linspace indices (what a straight
script does). Ours: count packets, decode once keeping only the F chosen frames. Prints seconds and
the peak RSS growth (each measured in a fresh process) for both, and the ratios.
Real clips come from PyPI packages (infra.demo.testmedia).

``--verify``: decode-and-verify of one sample at 33×832², before and after, against that sample's encode
(bench/verify_bench.py).

``--pool``: decode-only clips/s of the shard's read-ahead decoders (`infra.preprocess.decoders`, what ``--decode-pool
thread|process --decode-workers N`` runs) against the number of workers: real clips in a VBVR tar read on this
thread (as the shard loop reads them), prepared (PyAV decode, 33-frame sampling, resize) on the decoders with at
most `2 × workers` in flight (a read-ahead's bound), their pixels back here; no encoder. Each pool is started and
warmed on the clips once (untimed: its start-up is reported apart), then timed over `--clips` clips,
`--repeat` times::

    python bench/decode_bench.py --pool --size 256 --clips 32 --repeat 2
"""

from __future__ import annotations

import io
import multiprocessing as mp
import resource
import sys
import threading
import time

import av
import numpy as np

from infra.demo.testmedia import real_clip
from infra.media.video import sample_frames

FRAMES = 33
REPEATS = 3


def naive(data: bytes, count: int) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    idx = np.linspace(0, len(frames) - 1, count).round().astype(int)
    return np.stack([frames[i] for i in idx])


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def _peak_child(which: str, name: str, queue: mp.Queue) -> None:
    data = real_clip(name).read_bytes()
    fn = naive if which == "naive" else (lambda d, n: sample_frames(d, n).frames)
    fn(real_clip("carphone").read_bytes(), 1)  # warm the codec libraries on the smallest clip
    base, peak, running = _rss(), [0], [True]

    def sample() -> None:
        while running[0]:
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    watcher = threading.Thread(target=sample)
    watcher.start()
    result = fn(data, FRAMES)
    running[0] = False
    watcher.join()
    del result
    queue.put(peak[0] - base)


def peak_rss(which: str, name: str) -> int:
    """Growth of the peak RSS while decoding once, in a fresh process."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_peak_child, args=(which, name, queue))
    proc.start()
    value = queue.get(timeout=120)
    proc.join()
    return max(value, 1)


def best_time(fn, data: bytes) -> tuple[float, np.ndarray]:
    best, result = float("inf"), None
    for _ in range(REPEATS):
        start = time.perf_counter()
        result = fn(data)
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    print(f"{'clip':<14} {'naive s':>8} {'ours s':>8} {'time ×':>7} {'naive MB':>9} {'ours MB':>8} {'mem ×':>6}")
    for name in ("bigbuckbunny", "bikes", "carphone", "sample_1080p"):
        data = real_clip(name).read_bytes()
        t0, ref = best_time(lambda d: naive(d, FRAMES), data)
        t1, ours = best_time(lambda d: sample_frames(d, FRAMES).frames, data)
        assert np.array_equal(ref, ours), name
        m0, m1 = peak_rss("naive", name), peak_rss("ours", name)
        print(f"{name:<14} {t0:>8.3f} {t1:>8.3f} {t0 / t1:>7.2f} {m0 / 1e6:>9.1f} {m1 / 1e6:>8.1f} {m0 / m1:>6.2f}")


if __name__ == "__main__":
    if "--pool" in sys.argv[1:]:
        from decode_pool_bench import main as pool_main  # the script's own folder is on sys.path

        pool_main([a for a in sys.argv[1:] if a != "--pool"])
    elif "--verify" in sys.argv[1:]:
        from verify_bench import main as verify_main  # the script's own folder is on sys.path

        verify_main()
    else:
        main()
