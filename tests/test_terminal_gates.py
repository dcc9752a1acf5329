"""A terminal run never waits for an answer nobody can give: real `latentforge build` processes at the conflict gate
(a foreign OUT). On the embedded server (no PREFECT_API_URL) the person at the terminal is asked (a pty), and without
a terminal the run aborts at once naming the flags that decide unattended; on a real server the run pauses, and a
SIGTERM then ends it at once, not after its grace period."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from infra.audit.run_report import latest_run_report
from infra.errors import EXIT_PREEMPTED
from infra.ops import ephemeral
from tests.conftest import FRAMES, HEIGHT, WIDTH, make_shards, sample
from tests.media_utils import cut_clip
from tests.pauses import wait_pending
from tests.procs import cli_env

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 120  # far longer than a stop at a gate may take
WAIT_S = 240


@pytest.fixture(scope="module")
def source(clips, tmp_path_factory) -> Path:
    video = cut_clip(clips["carphone"], 9)
    return make_shards(tmp_path_factory.mktemp("gate-src"), {"s": [sample(0, 0, video, b"a car drives by")]})


def _foreign_out(tmp_path: Path) -> Path:
    """A directory latentforge did not create: the conflict gate must decide before anything is written."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    return out


def _build(src: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "flows.cli", "build", "--source", f"vbvr:{src}", "--model", str(model),
        "--out", str(out), "--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH),
        "--device", "cpu", "--dtype", "fp32", "--workers", "1", "--decode-samples", "0",
        "--grace-seconds", str(GRACE_S), *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_without_a_terminal_the_embedded_runs_gate_aborts_at_once_naming_the_flags(tmp_path, tiny_model, source):
    out = _foreign_out(tmp_path)
    done = subprocess.run(
        _build(source, tiny_model, out), env=cli_env(tmp_path / "home"), cwd=ROOT, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=WAIT_S,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    error = next(line for line in done.stderr.splitlines() if line.startswith("error: "))
    assert "add to the same command --approve-overwrite " in error and "--on-conflict new_dir" in error, error
    assert "waiting for a person" not in done.stderr
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert ephemeral.read_records(tmp_path / "home") == []  # its embedded server ended with it


class _Terminal:
    """A pty as a build's stdin, stdout and stderr; what the build writes is read on a thread (a full pty would
    block it)."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.master, child = os.openpty()
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdin=child, stdout=child, stderr=child)
        os.close(child)
        self.seen = b""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            ready, _, _ = select.select([self.master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # EIO: every writer of the pty has exited
                    return
                if not chunk:
                    return
                self.seen += chunk
            elif self.proc.poll() is not None:
                return

    def expect(self, text: bytes, after: int = 0) -> int:
        """Wait until `text` appears past offset `after`; its end's offset."""
        deadline = time.monotonic() + WAIT_S
        while (at := self.seen.find(text, after)) < 0:
            assert self.proc.poll() is None, self.seen.decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, self.seen.decode(errors="replace")[-3000:]
            time.sleep(0.1)
        return at + len(text)

    def type(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\n")

    def close(self) -> int:
        code = self.proc.wait(timeout=WAIT_S)
        self._reader.join(timeout=10)
        os.close(self.master)
        return code


@pytest.mark.slow
def test_at_a_terminal_the_embedded_runs_gate_asks_there_with_the_preview_and_choices(tmp_path, tiny_model, source):
    out = _foreign_out(tmp_path)
    terminal = _Terminal(_build(source, tiny_model, out), cli_env(tmp_path / "home"))
    try:
        asked = terminal.expect(b"conflict: your choice (abort, reuse, new_dir, overwrite)")
        preview = terminal.seen[:asked].decode(errors="replace")
        assert "### Choices" in preview and f"{out}-v2" in preview  # the pause form's markdown preview
        terminal.type("new_dir")
        terminal.expect(b"note", asked)
        terminal.type("moved by the test")
        code = terminal.close()
    finally:
        if terminal.proc.poll() is None:
            terminal.proc.kill()
    assert code == 0, terminal.seen.decode(errors="replace")[-3000:]
    assert (out / "notes.txt").read_text() == "mine" and not (out / "cache.json").exists()
    (decision,) = latest_run_report(tmp_path / "out-v2").decisions
    assert (decision.gate, decision.choice, decision.how, decision.note) == (
        "conflict",
        "new_dir",
        "person",
        "moved by the test",
    )
    assert decision.by.endswith("(at the terminal)")


@pytest.mark.slow
def test_a_run_paused_on_a_real_server_stops_at_once_on_sigterm(tmp_path, tiny_model, source, prefect_server):
    out = _foreign_out(tmp_path)
    url = prefect_server["PREFECT_API_URL"]
    env = cli_env(tmp_path / "home", PREFECT_API_URL=url)
    with subprocess.Popen(
        _build(source, tiny_model, out), env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    ) as build:  # fmt: skip
        wait_pending(url, build=build, match=lambda run: str(out) in run.preview, wait_s=WAIT_S)
        signalled = time.monotonic()
        build.send_signal(signal.SIGTERM)
        _, stderr = build.communicate(timeout=GRACE_S)
        stopped_in = time.monotonic() - signalled
    assert build.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert stopped_in < 10, f"a paused run took {stopped_in:.1f} s to stop (grace {GRACE_S} s)"
    assert "SIGTERM while waiting for a person (nothing in flight): stopping now" in stderr, stderr[-3000:]
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
