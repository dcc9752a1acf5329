"""Decode-ahead (`infra.preprocess.ahead`): a new build's first shard decoded by a forked process from the run's
start, used only for the same sample, recipe and bytes; the same rows and bytes as without it; the process and its
files gone with the run, a SIGKILL of the run included. And the console entry point's quick exit
(`infra.ops.quick_exit`): threads joined and exit handlers run, the status kept."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from infra.cache import ledger
from infra.media.video import MediaLimits
from infra.plan import make_plan, make_spec
from infra.preprocess import ahead, texts
from infra.preprocess.shard import process_shard
from infra.sources import SampleRef
from infra.sources.identity import SourceIdentity
from tests.conftest import FRAMES, HEIGHT, WIDTH, config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip, faststart
from tests.procs import cli_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="decode-ahead forks: Linux only")

USED = re.compile(r"decode-ahead: (\d+) sample\(s\) decoded by the start-up process and used")


@pytest.fixture(scope="module")
def source(tmp_path_factory, clips):
    """One shard: four good clips, a damaged clip (its packets cut at half), a missing video, a good clip again."""
    good = [cut_clip(clips[name], 12, width=160) for name in ("bikes", "carphone", "bigbuckbunny", "sample_1080p")]
    whole = faststart(clips["carphone"])
    samples = [sample(0, i, video, b"a ball rolls to the left") for i, video in enumerate(good)]
    samples += [sample(0, 4, whole[: len(whole) // 2], b"x"), sample(0, 5, None, b"y"), sample(0, 6, good[0], b"z")]
    return make_shards(tmp_path_factory.mktemp("ahead") / "src", {"mixed": samples})


def _command(src: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "flows.cli", "build", "--source", f"vbvr:{src}", "--model", str(model),
        "--out", str(out), "--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH),
        "--device", "cpu", "--dtype", "fp32", "--decode-samples", "0", "--on-loss", "accept", *extra,
    ]  # fmt: skip


def _facts(rows):
    return {k: (r.status, r.reason, r.sha256, r.seq_len) for k, r in rows.items()}


def _directories(pid: int) -> list[Path]:
    return sorted(ahead.base_directory().glob(f"{ahead.PREFIX}{pid}-*"))


def test_a_terminal_build_decodes_ahead_and_writes_the_rows_and_bytes_of_one_without(
    tmp_path, tiny_model, source
) -> None:
    out = tmp_path / "out"
    build = subprocess.Popen(
        _command(source, tiny_model, out), env=cli_env(tmp_path / "home"), stderr=subprocess.PIPE, text=True
    )
    _, stderr = build.communicate(timeout=300)
    assert build.returncode == 0, stderr[-3000:]
    used = USED.search(stderr)
    assert used is not None and int(used.group(1)) >= 1, stderr[-3000:]  # the child's pixels were encoded
    assert not _directories(build.pid)  # its files removed with it
    texts.clear()
    plan = make_plan(config(source, tiny_model, tmp_path / "alone", decode_ahead_mb=0))
    process_shard(plan, plan.shards[0])  # in this process: no decode-ahead (threads run here, and it is off)
    assert _facts(ledger.read_shard(out, "mixed")) == _facts(ledger.read_shard(tmp_path / "alone", "mixed"))
    pt = {k: v for k, v in tree_hashes(out).items() if k.endswith(".pt")}
    assert len(pt) == 5 and pt == {k: v for k, v in tree_hashes(tmp_path / "alone").items() if k.endswith(".pt")}
    reasons = {r.id.rsplit("_", 1)[1]: r.reason for r in ledger.read_shard(out, "mixed").values() if r.reason}
    assert reasons["00000005"] == "missing_video"  # a sample the child could not decode: its consumer's own row


def test_a_result_is_used_only_for_its_sample_recipe_and_bytes(tmp_path, tiny_model) -> None:
    spec, limits = make_spec(config(tmp_path, tiny_model, tmp_path / "out"))[1], MediaLimits()
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the child, alive
    ahead._child = ahead._Child(stand_in.pid, tmp_path / "dir")
    (tmp_path / "dir").mkdir()
    try:

        def ref(key: str, media: bytes | None) -> SampleRef:  # as a source's reader leaves it once it has read
            read = {} if media is None else {"ground_truth.mp4": hashlib.sha256(media).hexdigest()}
            identity = SourceIdentity(read_sha256=read)
            return SampleRef(key, "g", key, read_media=lambda: media, read_prompt=lambda: None, identity=identity)

        def decoded(key: str, media: bytes | None, *, recipe: str | None = None, fail: bool = False) -> Path:
            path = tmp_path / "dir" / ahead._name(key)
            path.with_suffix(".claim").touch()
            if fail:
                path.with_suffix(".fail").touch()
            elif media is not None:
                read = ref(key, media).identity.read_sha256
                payload = {"key": key, "recipe": recipe or ahead._recipe(spec, None, limits), "read_sha256": read}
                path.with_suffix(".pkl").write_bytes(pickle.dumps(payload | {"video": ("pixels", key)}))
            return path

        assert ahead.take(ref("new", b"n"), spec, limits) is None  # nobody decodes it: the consumer claims it
        assert (tmp_path / "dir" / ahead._name("new")).with_suffix(".claim").exists()
        assert ahead.take(ref("unread", None), spec, limits) is None  # no digest to compare: never claimed
        assert not (tmp_path / "dir" / ahead._name("unread")).with_suffix(".claim").exists()
        done = decoded("done", b"bytes")
        assert ahead.take(ref("done", b"bytes"), spec, limits) == ("pixels", "done")
        assert not done.with_suffix(".pkl").exists()  # taken: its file freed
        assert ahead.take(ref("done", b"bytes"), spec, limits) is None  # asked twice: decoded by the consumer
        decoded("changed", b"old bytes")
        assert ahead.take(ref("changed", b"new bytes"), spec, limits) is None
        decoded("other recipe", b"b", recipe="0" * 64)
        assert ahead.take(ref("other recipe", b"b"), spec, limits) is None
        decoded("failed", b"b", fail=True)
        assert ahead.take(ref("failed", b"b"), spec, limits) is None
        decoded("in flight", None)  # claimed, being decoded: the consumer waits, and the child dies meanwhile
        os.kill(stand_in.pid, signal.SIGKILL)
        started = time.monotonic()
        assert ahead.take(ref("in flight", b"b"), spec, limits) is None
        assert time.monotonic() - started < 5
    finally:
        stand_in.kill()
        stopped = ahead.stop()
    assert stopped == {"taken": 1} and not (tmp_path / "dir").exists()


def test_a_killed_build_takes_its_decode_ahead_process_and_files_with_it(tmp_path, tiny_model, clips) -> None:
    long = [sample(0, i, clips[name], b"p") for i, name in enumerate(["sample_1080p", "bigbuckbunny"] * 4)]
    src = make_shards(tmp_path / "src", {"long": long})
    build = subprocess.Popen(
        _command(src, tiny_model, tmp_path / "out"),
        env=cli_env(tmp_path / "home"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not _directories(build.pid) and time.monotonic() < deadline and build.poll() is None:
            time.sleep(0.02)
        assert _directories(build.pid), "no decode-ahead directory appeared"
        me, children = psutil.Process(build.pid), []
        while not children and time.monotonic() < deadline:  # the directory is made just before the fork
            children = [c for c in me.children() if c.cmdline() == me.cmdline()]  # the fork (the server: uvicorn)
        assert len(children) == 1
        servers = [c for c in me.children() if c not in children]
        build.send_signal(signal.SIGKILL)
        build.wait()
        gone, alive = psutil.wait_procs(children, timeout=60)  # niced: slow on a loaded machine
        assert not alive and not _directories(build.pid)
    finally:
        if build.poll() is None:
            build.kill()
        for server in locals().get("servers", []):
            with contextlib.suppress(psutil.Error):
                server.kill()  # the build's embedded Prefect server, orphaned by the SIGKILL


def _script(script: str, tmp_path: Path, tiny_model: Path, source: Path, *extra: str) -> subprocess.Popen:
    """A stand-in for the run: `script` in a process of its own, over the shard `source`; its stdout a pipe."""
    command = [sys.executable, "-c", script, str(source), str(tiny_model), str(tmp_path / "out"), *extra]
    return subprocess.Popen(command, env=cli_env(tmp_path / "home"), stdout=subprocess.PIPE, text=True)


def _until(condition, seconds: float) -> bool:
    """Wait until `condition()` holds, at most `seconds`; whether it does."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


ORPHAN = """
import ctypes, sys, threading, time
from pathlib import Path
from infra.plan import make_spec
from infra.preprocess import ahead
from tests.conftest import config
build = config(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
assert ahead.start(build, make_spec(build)[1])
threading.Thread(target=time.sleep, args=(60,)).start()  # the run's other threads, alive a while longer
while not any(ahead._child.directory.glob("*.claim")):  # the child has set up its parent-death signal
    time.sleep(0.01)
print(ahead._child.pid, flush=True)
ctypes.CDLL(None).pthread_exit(None)  # the main thread, which forked the child, ends first (as under a SIGKILL)
"""


def _running(process: psutil.Process) -> bool:
    """Alive and not a zombie (an ended child that nobody reaps while the run's last threads live on)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_child_removes_its_files_when_the_runs_main_thread_dies_before_the_others(
    tmp_path, tiny_model, source
) -> None:
    """The kernel sends the parent-death signal as the forking thread exits; `getppid` then still names the run,
    whose other threads are exiting. The child must not take that for the run's own `stop` (which removes the
    files itself): under a SIGKILL nobody else would."""
    run = _script(ORPHAN, tmp_path, tiny_model, source)
    try:
        child = psutil.Process(int(run.stdout.readline()))
        assert _until(lambda: not _running(child), 60) and run.poll() is None  # the run's process lives on
        assert not _directories(run.pid)
    finally:
        run.kill()
        run.wait()


DONE = """
import sys, time
from pathlib import Path
from infra.plan import make_spec
from infra.preprocess import ahead
from tests.conftest import config
build = config(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
assert ahead.start(build, make_spec(build)[1])
if sys.argv[4:] == ["hand-over"]:
    ahead.hand_over()  # as the shard's read-ahead does when it starts
print(ahead._child.pid, ahead._child.directory, flush=True)
time.sleep(120)  # the run, still importing or encoding, holds the results it has not taken
"""


def test_a_child_that_has_decoded_its_shard_holds_no_decoder_memory_and_still_goes_with_the_run(
    tmp_path, tiny_model, source
) -> None:
    """Done, the child marks its directory ended and becomes a small shell (~1 MB where the decoding process held
    ~150 MB of its own): the results stay for the run, and a SIGKILL of the run still removes them."""
    run = _script(DONE, tmp_path, tiny_model, source)
    try:
        pid, directory = run.stdout.readline().split()
        child, directory = psutil.Process(int(pid)), Path(directory)
        assert _until(lambda: (directory / ahead.ENDED).exists() and child.cmdline()[:1] == ["sh"], 120)
        assert child.memory_info().rss < 16 * 2**20
        assert len(list(directory.glob("*.pkl"))) == 5  # the decodable samples wait for the run
        run.kill()
        run.wait()
        assert _until(lambda: not _running(child), 30) and not directory.exists()
    finally:
        run.kill()
        run.wait()


def test_the_child_ends_once_the_run_hands_over_to_its_own_decoders(tmp_path, tiny_model, source) -> None:
    """From the shard's read-ahead on, the run decodes itself: the child claims no further sample and ends."""
    run = _script(DONE, tmp_path, tiny_model, source, "hand-over")
    try:
        directory = Path(run.stdout.readline().split()[1])
        assert _until((directory / ahead.ENDED).exists, 120) and (directory / ahead.HANDOVER).exists()
        assert len(list(directory.glob("*.claim"))) <= 1  # at most the sample in hand (7 in the shard)
    finally:
        run.kill()
        run.wait()


def test_a_consumer_stops_waiting_for_a_claimed_sample_once_the_child_has_ended(tmp_path) -> None:
    """A sample the child claimed but never finished (its writing failed, say, /dev/shm full) is the consumer's
    to decode as soon as the child marks itself ended, though its process (the shell) lives on."""
    stand_in = subprocess.Popen(["sleep", "30"])
    try:
        child = ahead._Child(stand_in.pid, tmp_path)
        path = tmp_path / ahead._name("g/1")
        assert ahead._claim(path)
        (tmp_path / ahead.ENDED).touch()
        started = time.monotonic()
        assert ahead._wait_for(child, path, SampleRef("1", "g", "g/1", lambda: None, lambda: None), "r") is None
        assert time.monotonic() - started < 1
    finally:
        stand_in.kill()
        stand_in.wait()


@pytest.mark.parametrize("name", ["pytorch_model.bin", "diffusion_pytorch_model.safetensors"])
def test_hashing_a_new_models_files_leaves_no_thread_behind(tmp_path, monkeypatch, name) -> None:
    """A first build of a snapshot hashes its weights before the fork; tqdm starts a monitor thread even for a
    disabled bar and never ends it, which would turn decode-ahead off for exactly that build. (Random bytes under a
    safetensors name: hashed, not taken for a header of 2**64 bytes.)"""
    from tqdm import tqdm  # noqa: PLC0415

    from infra.models import identity  # noqa: PLC0415

    if tqdm.monitor is not None:  # another test's bar: ended, so that a new one would show
        tqdm.monitor.exit()
        tqdm.monitor = None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # nothing remembered: hashed now
    weights = tmp_path / name
    weights.write_bytes(os.urandom(1 << 20))
    before = {t.ident for t in threading.enumerate()}
    assert identity.file_sha256(weights) == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert {t.name for t in threading.enumerate() if t.ident not in before} == set()


QUICK = """
import atexit, sys, threading, time
from pathlib import Path
where = Path(sys.argv[1])
def handler():
    (where / "handler").write_text(str((where / "thread").exists()))
atexit.register(handler)
def late():
    time.sleep(0.5)
    (where / "thread").write_text("done")
threading.Thread(target=late).start()  # not a daemon: the interpreter would wait for it
from flows.cli import main
sys.argv = ["latentforge", *sys.argv[2:]]
main()
"""


@pytest.mark.parametrize(("argv", "status"), [(["--help"], 0), (["build", "--no-such-flag"], 2)])
def test_the_entry_points_quick_exit_joins_threads_runs_exit_handlers_and_keeps_the_status(
    tmp_path, argv, status
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", QUICK, str(tmp_path), *argv], env=cli_env(tmp_path / "home"), capture_output=True
    )
    assert proc.returncode == status, proc.stderr[-2000:]
    assert (tmp_path / "thread").read_text() == "done"
    assert (tmp_path / "handler").read_text() == "True"  # handlers after the threads, as the interpreter orders them


def test_a_waiting_result_holds_its_pixels_once(tmp_path, tiny_model, clips) -> None:
    """What the child pickles into /dev/shm (and a prefetched sample holds) is the pixels once: the clip's record
    keeps no second reference, whose pickle would write the same pixels again."""
    from infra.preprocess.encode import prepare_pixels  # noqa: PLC0415

    spec = make_spec(config(tmp_path, tiny_model, tmp_path / "out"))[1]
    video = prepare_pixels(clips["bikes"], spec, None, MediaLimits())
    size = len(pickle.dumps(video, protocol=pickle.HIGHEST_PROTOCOL))
    assert video.pixels.nbytes < size < video.pixels.nbytes + 64 * 1024
