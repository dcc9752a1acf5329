"""Hostile files and secrets: a planted pickle never runs wherever latentforge reads a file; tar members never
write outside OUT; secrets passed the ways a user passes them are never written anywhere."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import boto3
import pytest
import torch
from prefect.settings import PREFECT_API_URL, PREFECT_HOME, PREFECT_SERVER_DATABASE_CONNECTION_URL
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.audit.run_report import run_report_paths
from infra.cache import ledger
from infra.preprocess.one_sample import MARKER, sanity_dir
from tests import s3_server
from tests.conftest import FRAMES, HEIGHT, WIDTH, config, make_shards, sample
from tests.media_utils import cut_clip
from tests.receiver import receiver

ROOT = Path(__file__).resolve().parents[1]
moto_server, s3_env = s3_server.moto_server, s3_server.s3_env  # the fixtures, by name


class Payload:
    """Unpickled, it creates `marker`: what a hostile .pt/.bin would do with a plain ``torch.load``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


def _hostile(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"x0": Payload(marker)}, buffer)  # a real torch zip file with the payload in its data.pkl
    return buffer.getvalue()


def _plant(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.fixture(scope="module")
def src(clips, tmp_path_factory) -> Path:
    video = cut_clip(clips["carphone"], 9, width=96)
    samples = [sample(i % 2, i, video, f"a call, take {i}".encode()) for i in range(2)]
    return make_shards(tmp_path_factory.mktemp("sec-src"), {"shard-00000": samples})


def test_the_payload_is_live(tmp_path):
    """The planted files below are really hostile: loaded the unsafe way, the payload runs."""
    marker = tmp_path / "ran"
    path = _plant(tmp_path / "x.pt", _hostile(marker))
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_a_planted_pickle_never_runs_wherever_a_file_is_read(tmp_path, tiny_model, src):
    marker = tmp_path / "PAYLOAD-RAN"
    hostile = _hostile(marker)
    cli = CliRunner()

    # The model directory: a pickled .bin/.pt beside every component's config, and at its top.
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    planted = [_plant(model / "vae" / "diffusion_pytorch_model.bin", hostile)]
    planted += [_plant(model / "text_encoder" / "pytorch_model.bin", hostile)]
    planted += [_plant(model / "tokenizer" / "added_tokens.pt", hostile), _plant(model / "extra.pt", hostile)]
    # OUT.sanity, made by latentforge before (its marker file), holding a pickle where the sample goes.
    out = tmp_path / "out"
    scratch = sanity_dir(out)
    _plant(scratch / MARKER, b"scratch space of latentforge's sanity check; its files are replaced\n")
    planted += [_plant(scratch / "planted.pt", hostile)]
    ok, result = run_build(config(src, model, out, decode_samples=1))
    assert ok and result["done"] == 2, result
    assert not marker.exists()

    # OUT: a sample replaced by a pickle, another one planted; reports: the newest run report and a .pt there.
    row = next(r for rows in ledger.read_all(out).values() for r in rows.values() if r.status == "done")
    original = (out / row.path).read_bytes()
    planted += [_plant(out / row.path, hostile), _plant(out / row.group / "planted.pt", hostile)]
    newest = run_report_paths(out)[-1]
    planted += [_plant(newest.with_name(newest.name.replace("run-2", "run-9", 1)), hostile)]
    assert run_report_paths(out)[-1] == planted[-1]  # read first: it is the newest by name
    planted += [_plant(out / "reports" / "planted.pt", hostile)]

    answers = {
        "verify": cli.invoke(app, ["verify", str(out)]),
        "inspect": cli.invoke(app, ["inspect", str(out)]),
        "decode": cli.invoke(app, ["decode", str(out), "--model", str(model), "--device", "cpu"]),
        "build": cli.invoke(app, ["build", "--source", f"vbvr:{src}", "--model", str(model), "--out", str(out),
                                  "--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH),
                                  "--device", "cpu", "--dtype", "fp32", "--on-conflict", "abort"]),
    }  # fmt: skip
    (out / row.path).write_bytes(original)  # whole again: the upload reads on, to the planted run report
    answers["upload"] = cli.invoke(app, ["upload", str(out), "--to", "s3://no-bucket/x"])
    assert not marker.exists(), "a planted pickle was unpickled"
    for command, answer in answers.items():
        assert "Traceback" not in answer.output, f"{command} crashed:\n{answer.output}"
    refused = "does not load with weights_only=True"
    assert answers["verify"].exit_code == 1 and "damaged" in answers["verify"].output.lower()
    assert refused in answers["verify"].output and row.path in answers["verify"].output
    assert answers["inspect"].exit_code == 1 and refused in answers["inspect"].output
    assert "1 problem" in answers["decode"].output and "Weights only load failed" in answers["decode"].output
    assert answers["build"].exit_code == 1 and refused in answers["build"].output
    assert answers["upload"].exit_code == 1 and planted[-2].name in answers["upload"].output, answers["upload"].output
    assert all(p.exists() for p in planted)  # reported, never deleted

    # A component whose only weights are the pickle: the loaders' torch.load(weights_only=True) refuses it.
    for weights in (model / "vae").glob("*.safetensors"):
        weights.unlink()
    ok, result = run_build(config(src, model, tmp_path / "out-bin-only"))
    assert not ok and "ModelLoadError" in str(result) and "vae/diffusion_pytorch_model.bin" in str(result), result
    assert not marker.exists(), "a planted pickle was unpickled"


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w") as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mtime = kind, link, 1_700_000_000
    return info


def test_hostile_tar_member_names_never_write_outside_out(tmp_path, tiny_model, clips):
    video, sid = cut_clip(clips["carphone"], 9, width=96), "t_task/t_00000001"
    members = [
        (_member(f"G-1/{sid}/ground_truth.mp4"), video),
        (_member(f"G-1/{sid}/prompt.txt"), b"the real one"),
        (_member(f"../escape/{sid}/ground_truth.mp4"), video),
        (_member(f"../escape/{sid}/prompt.txt"), b"dot dot"),
        (_member(f"/abs-{uuid.uuid4().hex}/{sid}/prompt.txt"), b"absolute"),
        (_member(f"G-2/{sid}/ground_truth.mp4", tarfile.SYMTYPE, "/etc/passwd"), None),
        (_member(f"G-2/{sid}/prompt.txt"), b"a symlink for a video"),
        (_member(f"G-3/{sid}/ground_truth.mp4", tarfile.LNKTYPE, f"G-1/{sid}/ground_truth.mp4"), None),
        (_member(f"G-3/{sid}/prompt.txt"), b"a hard link for a video"),
    ]
    (tmp_path / "src").mkdir()
    _tar(tmp_path / "src" / "shard-00000.tar", members)
    out = tmp_path / "work" / "out"
    ok, result = run_build(config(tmp_path / "src", tiny_model, out, workers=1))
    assert ok, result
    rows = {key: r for rows in ledger.read_all(out).values() for key, r in rows.items()}
    assert len(rows) == 5, rows  # every sample directory, hostile or not, has its row
    assert [k for k, r in rows.items() if r.status == "done"] == [f"G-1/{sid}"]
    reasons = {k: r.reason for k, r in rows.items() if r.status != "done"}
    assert reasons[f"G-2/{sid}"] == reasons[f"G-3/{sid}"] == "missing_video", reasons  # links are not followed
    assert sum(r == "bad_layout" for r in reasons.values()) == 2, reasons
    outside = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert all(p.startswith(("src/", "work/out/", "work/out.sanity/")) for p in outside), outside


@pytest.mark.slow
def test_secrets_passed_by_env_and_config_are_written_nowhere(tmp_path, tiny_model, src, s3_env, monkeypatch):
    token = uuid.uuid4().hex
    secrets = {
        "HF_TOKEN": f"hf_{token}HF",
        "AWS_SECRET_ACCESS_KEY": f"aws{token}AWS",
        "LATENTFORGE_ALERT_WEBHOOK": f"env{token}ENV",  # the flag's URL wins over it, but it is a secret too
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    boto3.client("s3").create_bucket(Bucket="sec")
    out, foreign = tmp_path / "out", tmp_path / "foreign"
    _plant(foreign / "theirs.txt", b"not a cache")
    run_env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_API_URL": PREFECT_API_URL.value()}
    common = ["--source", f"vbvr:{src}", "--model", str(tiny_model), "--frames", str(FRAMES),
              "--height", str(HEIGHT), "--width", str(WIDTH), "--device", "cpu", "--dtype", "fp32",
              "--on-conflict", "abort", "--on-loss", "accept", "--decode-samples", "0"]  # fmt: skip
    logs = []
    with receiver() as hook:
        file_hook, flag_hook = f"{hook.url}/file/{token}FILE", f"{hook.url}/flag/{token}FLAG"
        secrets |= {"config webhook": f"{token}FILE", "flag webhook": f"{token}FLAG"}
        config_file = _plant(tmp_path / "lf.yaml", json.dumps({"alerts": {"webhook": file_hook}}).encode())
        builds = [  # at once: they share nothing but the server (their imports overlap)
            subprocess.Popen(
                [sys.executable, "-m", "flows.cli", "build", *common, *extra],
                env=run_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for extra in (["--out", str(out), "--config", str(config_file), "--upload", "s3://sec/cache"],
                          ["--out", str(foreign), "--alert-webhook", flag_hook])
        ]  # fmt: skip
        try:
            logs += [build.communicate(timeout=400)[0] for build in builds]
        finally:
            for build in builds:
                build.kill()
        assert "uploaded" in logs[0], logs[0][-3000:]
        assert "error:" in logs[1] and "foreign" in logs[1], logs[1][-3000:]
        alert = hook.wait_for(lambda body: isinstance(body, dict) and body.get("kind") == "failed")
    assert hook.received[-1]["path"].endswith(f"/flag/{token}FLAG")  # the flag's webhook was used, from the environment
    assert alert["flow"] == "build-cache"

    database = Path(PREFECT_SERVER_DATABASE_CONNECTION_URL.value().split("///", 1)[1])
    written = {f"log {i}": text.encode() for i, text in enumerate(logs)}
    for root in (out, sanity_dir(out), foreign, database.parent, Path(PREFECT_HOME.value())):
        written |= {str(p): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    s3 = boto3.client("s3")
    for item in s3.list_objects_v2(Bucket="sec").get("Contents", []):
        written[f"s3://sec/{item['Key']}"] = s3.get_object(Bucket="sec", Key=item["Key"])["Body"].read()
    assert any(str(out).encode() in data for name, data in written.items() if name.startswith(str(database.parent)))
    assert "s3://sec/cache/README.md" in written  # the card, published
    leaks = [(what, at) for what, value in secrets.items() for at, data in written.items() if value.encode() in data]
    assert not leaks, f"secrets written: {leaks}"
