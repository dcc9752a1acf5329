"""Prefetching inside a shard: the same rows and the same bytes as one sample at a time (on decoder threads or
decoder processes), a damaged clip's error still reported from the decoders, a decoder process killed mid-shard
costing no sample, a stop between samples still honoured, prompts encoded once."""

from __future__ import annotations

import pickle
import signal
import threading
import time

import psutil
import pytest
import torch

from infra.cache import ledger
from infra.faults import KILL_FILE_ENV
from infra.ops.progress import RunState
from infra.plan import make_plan
from infra.preprocess.decoders import DECODER_POINT, ProcessDecoders, ThreadDecoders
from infra.preprocess.prefetch import Prefetcher
from infra.preprocess.prepare import prepare
from infra.preprocess.read import RawSample
from infra.preprocess.shard import process_shard
from infra.sources import SampleRef
from tests.conftest import config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip, faststart

CLIP_FRAMES = 12
PROMPTS = (b"a ball rolls to the left", b"an object hides and comes back")
SERIAL = {"prefetch": 0, "text_batch": 1}
AHEAD = {"prefetch": 3, "decode_workers": 2, "text_batch": 4}
PROCESSES = {**AHEAD, "decode_pool": "process"}


@pytest.fixture(scope="module")
def source(tmp_path_factory, clips):
    """One shard: four good clips under two prompts, a damaged clip (its packets cut at half), a missing video."""
    good = [
        cut_clip(clips[name], CLIP_FRAMES, width=160) for name in ("bikes", "carphone", "bigbuckbunny", "sample_1080p")
    ]
    whole = faststart(clips["carphone"])
    damaged = whole[: len(whole) // 2]
    samples = [sample(0, i, video, PROMPTS[i % 2]) for i, video in enumerate(good)]
    samples += [sample(0, 4, damaged, PROMPTS[0]), sample(0, 5, None, PROMPTS[1]), sample(0, 6, good[0], b"once")]
    return make_shards(tmp_path_factory.mktemp("prefetch") / "src", {"mixed": samples})


def _build(source, model, out, **options):
    plan = make_plan(config(source, model, out, **options))
    result = process_shard(plan.job, plan.shards[0])
    return result, ledger.read_shard(out, "mixed"), (result.text_calls, result.prompts_encoded)


def _facts(rows):
    return {k: (r.status, r.reason, r.sha256, r.seq_len) for k, r in rows.items()}


def test_prefetched_rows_and_bytes_equal_one_at_a_time(tmp_path, tiny_model, source) -> None:
    _, serial, serial_text = _build(source, tiny_model, tmp_path / "serial", **SERIAL)
    result, ahead, ahead_text = _build(source, tiny_model, tmp_path / "ahead", **AHEAD)
    assert _facts(ahead) == _facts(serial) and len(ahead) == 7
    files = {k: v for k, v in tree_hashes(tmp_path / "ahead").items() if k.endswith(".pt")}
    assert len(files) == result.counts["done"] and files == {
        k: v for k, v in tree_hashes(tmp_path / "serial").items() if k.endswith(".pt")
    }
    reasons = {r.id.rsplit("_", 1)[1]: r.reason for r in ahead.values() if r.status != "done"}
    assert reasons.get("00000005") == "missing_video"
    # the damaged clip: refused with the decoder's error, or (exactly as without threads) what decodes of it
    assert reasons.get("00000004", "video_decode_error") == "video_decode_error"
    assert result.counts["done"] >= 5
    unique = len(set(PROMPTS)) + 1
    assert serial_text == (unique, unique)  # identical prompts once, even unbatched
    assert ahead_text[1] == unique and ahead_text[0] < unique  # batched with upcoming prompts


def _pt_files(out):
    return {k: v for k, v in tree_hashes(out).items() if k.endswith(".pt")}


def test_decoder_processes_write_the_threads_bytes_and_rows(tmp_path, tiny_model, source) -> None:
    """``--decode-pool process``: the same ledger facts (the damaged clip's and the missing video's reasons
    included) and the same files, byte for byte, as the default decoder threads."""
    threads, thread_rows, _ = _build(source, tiny_model, tmp_path / "threads", **AHEAD)
    processes, process_rows, _ = _build(source, tiny_model, tmp_path / "processes", **PROCESSES)
    assert _facts(process_rows) == _facts(thread_rows) and len(process_rows) == 7
    assert processes.counts == threads.counts and processes.counts["done"] >= 5
    assert _pt_files(tmp_path / "processes") == _pt_files(tmp_path / "threads")
    assert len(_pt_files(tmp_path / "processes")) == processes.counts["done"]


def test_a_killed_decoder_process_costs_no_sample(tmp_path, tiny_model, source, monkeypatch) -> None:
    """A decoder process SIGKILLed at its first decode (as a crash in FFmpeg or the OOM killer ends one) breaks
    its pool: the samples in it are decoded again in a fresh pool, and the shard's rows and bytes are those of a
    build where nothing died."""
    _, serial, _ = _build(source, tiny_model, tmp_path / "serial", **SERIAL)
    kill = tmp_path / "kill"
    kill.write_text(DECODER_POINT)
    monkeypatch.setenv(KILL_FILE_ENV, str(kill))  # read by the decoder processes, spawned with this environment
    result, rows, _ = _build(source, tiny_model, tmp_path / "killed", **PROCESSES)
    assert not kill.exists() and list(tmp_path.glob("kill.*")), "no decoder process was killed"
    assert _facts(rows) == _facts(serial)
    assert _pt_files(tmp_path / "killed") == _pt_files(tmp_path / "serial") and result.counts["done"] >= 5


def test_decoder_processes_leave_a_stop_to_the_shard(tmp_path, tiny_model, clips, source) -> None:
    """A Ctrl-C reaches the terminal's whole process group, a SIGTERM may: the decoder processes ignore both (the
    shard stops between samples and shuts them down); the same processes decode the next sample."""
    plan = make_plan(config(source, tiny_model, tmp_path / "out"))
    ref = SampleRef(id="1", group="g", key="g/1", read_media=lambda: None, read_prompt=lambda: None)
    raw = RawSample(ref, "p", clips["carphone"])
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    pool = ProcessDecoders(plan.job, workers=1)
    try:
        first = pool.submit(raw).result(timeout=120)
        decoders = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        decoders = [p for p in decoders if "spawn_main" in " ".join(p.cmdline())]
        assert len(decoders) == 1
        for signum in (signal.SIGINT, signal.SIGTERM):
            decoders[0].send_signal(signum)
        time.sleep(0.5)
        assert decoders[0].is_running() and decoders[0].status() != psutil.STATUS_ZOMBIE
        again = pool.submit(raw).result(timeout=120)
    finally:
        pool.shutdown()
    assert torch.equal(again.video.pixels, first.video.pixels)
    assert torch.equal(first.video.pixels, prepare(raw, plan.job).video.pixels)  # the threads' pixels, bit for bit


def test_a_stop_between_samples_ends_the_shard_with_prefetch(tmp_path, tiny_model, source) -> None:
    seen: list[str] = []
    run = RunState("stopped", stop=lambda: "SIGTERM" if len(seen) >= 2 else None)  # as a SIGTERM after two samples
    plan = make_plan(config(source, tiny_model, tmp_path / "out", **AHEAD))
    result = process_shard(plan.job, plan.shards[0], on_row=lambda row: seen.append(row.key), run=run)
    assert result.interrupted == "SIGTERM"
    rows = ledger.read_shard(tmp_path / "out", "mixed")
    assert sorted(rows) == sorted(seen) and len(rows) == 2  # nothing past the stop was written or recorded
    plan = make_plan(config(source, tiny_model, tmp_path / "out", on_conflict="reuse", **AHEAD))
    resumed = process_shard(plan.job, plan.shards[0])
    assert resumed.reused == 2 and len(ledger.read_shard(tmp_path / "out", "mixed")) == 7


def test_the_source_is_not_moved_past_a_sample_that_was_not_read_ahead() -> None:
    """A sample kept from the ledger may read its source while visited (a stale check): the source (a tar, one file
    position; closed at its end) is not advanced past it until the loop moves on."""
    pulled: list[int] = []

    def refs():
        for i in range(6):
            pulled.append(i)
            yield SampleRef(id=str(i), group="g", key=str(i), read_media=lambda: b"v", read_prompt=lambda: b"p")

    kept = {"1", "2"}  # done in the ledger: not read ahead
    ahead = Prefetcher(
        refs(), read=lambda ref: RawSample(ref, "p", b"v"), decoders=ThreadDecoders(lambda raw: raw.ref.key, 1),
        wanted=lambda r: r.key not in kept, depth=2, lookahead=3,
    )  # fmt: skip
    seen = []
    for ref in ahead:
        seen.append((ref.key, len(pulled)))
        taken = ahead.take(ref)
        assert (taken is None) == (ref.key in kept)
        if taken is not None:
            assert taken == ref.key  # what was prepared ahead for it
    ahead.close()
    assert [key for key, _ in seen] == [str(i) for i in range(6)]
    assert dict(seen)["0"] == 2 and dict(seen)["1"] == 2 and dict(seen)["2"] == 3  # stops at each kept one


def test_a_waiting_sample_holds_its_pixels_once(tmp_path, tiny_model, clips, source) -> None:
    """A sample prepared ahead holds its pixels once: not the source-resolution frames, and the clip's record keeps
    no second reference to the pixels (a pickle of it, as a Ray object or a queue would hold, is the pixels once)."""
    plan = make_plan(config(source, tiny_model, tmp_path / "out"))
    ref = SampleRef(id="1", group="g", key="g/1", read_media=lambda: None, read_prompt=lambda: None)
    prepared = prepare(RawSample(ref, "p", clips["bikes"]), plan.job)
    assert prepared.video.clip.frames.size == 0 and prepared.video.clip.pixels is None
    size = len(pickle.dumps(prepared.video, protocol=pickle.HIGHEST_PROTOCOL))
    assert prepared.video.pixels.nbytes < size < prepared.video.pixels.nbytes + 64 * 1024


def _in_a_new_thread(call):
    got = []
    thread = threading.Thread(target=lambda: got.append(call()))
    thread.start()
    thread.join()
    return got[0]


def test_decoder_threads_share_the_intra_op_threads_and_leave_the_rest_theirs() -> None:
    """Each of `workers` decoder threads computes with its share of the intra-op threads torch gives a new thread
    here (not a whole team each, whose waiting threads spin on the cores the others decode on); the calling thread,
    and a thread started afterwards (an encoder's), keep theirs."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)  # what a new thread starts with (a pinned CPU build's, a host's cores)
    try:
        for workers, team in ((1, 4), (2, 2), (3, 1), (8, 1)):
            pool = ThreadDecoders(lambda _raw: torch.get_num_threads(), workers)
            try:
                teams = {pool.submit(None).result() for _ in range(3 * workers)}
            finally:
                pool.shutdown()
            assert teams == {team}, workers
            assert torch.get_num_threads() == 4
            assert _in_a_new_thread(torch.get_num_threads) == 4
    finally:
        torch.set_num_threads(before)
