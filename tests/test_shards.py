"""Shard formats (webdataset, parquet) end to end: real builds of the tiny Wan2.2 and LTX-2 models, read back
through latentforge's readers and through the libraries trainers use (webdataset, pyarrow, `datasets`); the
encoder's fingerprint in every shard; same inputs, same bytes; reconcile, inspect and upload over shard files."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import boto3
import datasets
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import webdataset
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.audit.decode_verify import decode_and_verify
from infra.audit.inspect import format_report, inspect_cache
from infra.cache import ledger
from infra.errors import ConfigError
from infra.faults import LOG_ENV
from infra.formats import get_format
from infra.formats.parquet import SCHEMA_T2V
from infra.formats.shards import META_JSON, MixedFingerprints
from infra.formats.stream import stream_samples
from infra.plan import make_plan, make_spec
from infra.storage import TEMP_SUFFIX
from tests import s3_server
from tests.conftest import config, make_shards, sample, tree_hashes
from tests.media_utils import cut_clip
from tests.steps import reconciled, verified

moto_server, s3_env = s3_server.moto_server, s3_server.s3_env
FORMATS = ("webdataset", "parquet")
FAMILIES = ("wan22", "ltx2")
SUFFIX = {"webdataset": ".tar", "parquet": ".parquet"}
#: Samples per shard file: 3 samples per source shard make two parts each, the second one short.
PER_PART = 2
SAMPLES = 6
LTX2_GEOMETRY = {"frames": 9, "height": 64, "width": 96}


@pytest.fixture(scope="module")
def source(clips, tmp_path_factory) -> Path:
    videos = [cut_clip(clips[name], 10, width=160) for name in ("bikes", "carphone", "bigbuckbunny")]
    shard_a = [sample(0, i, videos[i], f"clip {i} of group zero".encode()) for i in range(3)]
    shard_b = [sample(1, i, videos[2 - i], f"clip {i} of group one, é".encode()) for i in range(3)]
    return make_shards(tmp_path_factory.mktemp("shards-src"), {"shard-a": shard_a, "shard-b": shard_b})


def shard_config(src: Path, model: Path, out: Path, fmt: str, family: str, **overrides: object):
    geometry = LTX2_GEOMETRY if family == "ltx2" else {}
    if (fmt, family) == ("parquet", "ltx2"):  # what FastVideo's LTX2Model reads (pre-connector is refused)
        geometry = {**geometry, "text_stage": "post_connector"}
    return config(src, model, out, format=fmt, shard_samples=PER_PART, **{**geometry, **overrides})


@pytest.fixture(scope="module")
def builds(source, tiny_model, ltx2_model, tmp_path_factory):
    """One build per (format, family), made when first asked for."""
    made: dict[tuple[str, str], Path] = {}
    models = {"wan22": tiny_model, "ltx2": ltx2_model}

    def build(fmt: str, family: str) -> Path:
        if (fmt, family) not in made:
            out = tmp_path_factory.mktemp(f"{fmt}-{family}") / "out"
            ok, result = run_build(shard_config(source, models[family], out, fmt, family))
            assert ok, result
            assert (result["done"], result["encoded"]) == (SAMPLES, SAMPLES)
            made[(fmt, family)] = out
        return made[(fmt, family)]

    return build


def _parts(out: Path) -> list[Path]:
    return sorted(p for p in (out / "shards").iterdir() if not p.name.startswith("."))


def _done(out: Path) -> list[ledger.LedgerRow]:
    rows = [row for rows in ledger.read_all(out).values() for row in rows.values()]
    assert len(rows) == SAMPLES and all(r.status == "done" for r in rows)
    return rows


def _library_check(fmt: str, out: Path, rows: list[ledger.LedgerRow]) -> None:
    """Read every shard with the library a trainer uses; the values are the ledger's samples'."""
    urls = [str(p) for p in _parts(out)]
    ours = {row.member: get_format(fmt).read_file(out, row.output_files()[0]) for row in rows}
    if fmt == "webdataset":
        stream = webdataset.WebDataset(urls, shardshuffle=False).decode().to_tuple("__key__", "npy", "txt", "json")
        seen = {key: (npy, txt, meta) for key, npy, txt, meta in stream}
        assert seen.keys() == ours.keys()
        for key, (npy, txt, meta) in seen.items():
            assert npy.dtype == np.float32 and np.array_equal(npy, ours[key]["latents"].float().numpy())
            assert txt == ours[key]["prompt"] and meta["fingerprint"] == rows[0].fingerprint
        return
    table = pq.read_table(urls[0])
    assert table.schema.remove_metadata().equals(SCHEMA_T2V)  # FastVideo's t2v schema, column for column
    assert table.schema.metadata[b"latentforge.fingerprint"].decode() == rows[0].fingerprint
    loaded = datasets.load_dataset("parquet", data_files=urls, split="train", cache_dir=str(out.parent / "hf"))
    assert len(loaded) == SAMPLES and set(loaded["id"]) == set(ours)
    for row in loaded:  # FastVideo's reader: float32 from the bytes, whatever the dtype column says
        latents = np.frombuffer(row["vae_latent_bytes"], dtype=np.float32).reshape(row["vae_latent_shape"])
        text = np.frombuffer(row["text_embedding_bytes"], dtype=np.float32).reshape(row["text_embedding_shape"])
        assert np.array_equal(latents, ours[row["id"]]["latents"].float().numpy())
        assert np.array_equal(text, ours[row["id"]]["text_embeddings"].float().numpy())
        assert row["caption"] == ours[row["id"]]["prompt"] and row["vae_latent_dtype"] == "float32"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_build_round_trips_through_its_reader_and_the_trainers_library(builds, fmt, family):
    out = builds(fmt, family)
    rows = _done(out)
    names = [p.name for p in _parts(out)]
    suffix = SUFFIX[fmt]
    assert names == [f"shard-{s}-{p:05d}{suffix}" for s in "ab" for p in (0, 1)]  # rotated at PER_PART samples
    fmt_obj, fingerprint = get_format(fmt), rows[0].fingerprint
    for row in rows:  # the ledger says where each sample lives: its shard file and its key there
        record = fmt_obj.read_file(out, row.output_files()[0])
        assert row.path in {f"shards/{n}" for n in names} and row.member
        assert record["latents"].dtype == torch.bfloat16 and list(record["latents"].shape) == row.latent_shape
        assert record["text_embeddings"].dtype == torch.bfloat16 and record["fingerprint"] == fingerprint
        if fmt == "parquet":  # as FastVideo stores them: Wan's prompt rows (its collate pads them), LTX-2's all
            assert record["text_embeddings"].shape[0] == (row.seq_len if family == "wan22" else 1024)
    streamed = list(stream_samples(out))
    assert len(streamed) == SAMPLES and {s["fingerprint"] for s in streamed} == {fingerprint}
    _library_check(fmt, out, rows)
    meta = json.loads((out / META_JSON).read_text())  # the index, written last
    assert (meta["samples"], meta["fingerprint"], [s["samples"] for s in meta["shards"]]) == (
        SAMPLES,
        fingerprint,
        [2, 1, 2, 1],
    )
    for entry in meta["shards"]:
        assert entry["sha256"] == hashlib.sha256((out / entry["url"]).read_bytes()).hexdigest()


def test_tar_members_have_fixed_owner_time_and_order(builds):
    out = builds("webdataset", "wan22")
    with tarfile.open(_parts(out)[0]) as tar:
        members = tar.getmembers()
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in members} == {(0, 0, 0, "", "", 0o644)}
    exts = [m.name.split(".", 1)[1] for m in members]
    assert exts == ["npy", "text_embeddings.npy", "txt", "json"] * 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_same_inputs_give_byte_identical_shards(builds, source, tiny_model, tmp_path, fmt):
    again = tmp_path / "again"
    ok, result = run_build(shard_config(source, tiny_model, again, fmt, "wan22", workers=1))
    assert ok, result
    first = {k: v for k, v in tree_hashes(builds(fmt, "wan22")).items() if k.startswith("shards/")}
    assert first and first == {k: v for k, v in tree_hashes(again).items() if k.startswith("shards/")}


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_encoders_are_never_streamed_together_unless_asked(builds, fmt):
    wan, ltx = builds(fmt, "wan22"), builds(fmt, "ltx2")
    mixed = [*_parts(wan)[:1], *_parts(ltx)[:1]]
    with pytest.raises(MixedFingerprints, match="2 different encoders"):
        next(stream_samples(mixed))
    together = list(stream_samples(mixed, allow_mixed=True))
    assert len(together) == 4 and len({s["fingerprint"] for s in together}) == 2
    report = inspect_cache(wan)  # inspect reads the fingerprints found in the shard files themselves
    assert report["shards"] == {"files": 4, "samples": SAMPLES, "fingerprints": {_done(wan)[0].fingerprint: 4}}
    assert "shard files  4 holding 6 samples" in format_report(report)


def test_reconcile_counts_samples_inside_shards(builds, source, tiny_model, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(builds("webdataset", "wan22"), out)
    cfg = shard_config(source, tiny_model, out, "webdataset", "wan22")
    assert reconciled(make_plan(cfg)).produced == SAMPLES
    (out / "shards/shard-b-00000.tar").unlink()  # two samples gone with their shard file
    report = reconciled(make_plan(cfg))
    assert (report.produced, {m.reason for m in report.missing}) == (SAMPLES - 2, {"file_missing"})
    assert json.loads((out / META_JSON).read_text())["samples"] == SAMPLES - 2


def test_upload_sends_whole_shard_files_each_once(builds, s3_env, tmp_path):
    out = builds("parquet", "wan22")
    bucket = "lf-shards"
    client = boto3.client("s3")
    client.create_bucket(Bucket=bucket)
    sent = CliRunner().invoke(app, ["upload", str(out), "--to", f"s3://{bucket}/c"])
    assert sent.exit_code == 0, sent.output
    objects = {o["Key"]: o["Size"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    shards = {k.removeprefix("c/"): size for k, size in objects.items() if k.startswith("c/shards/")}
    assert shards == {f"shards/{p.name}": p.stat().st_size for p in _parts(out)}
    assert "c/_meta.json" in objects and "c/cache.json" in objects


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_after_a_crash_mid_part_reuses_finished_parts_and_ends_byte_identical(
    builds, source, tiny_model, tmp_path, monkeypatch, fmt
):
    reference = builds(fmt, "wan22")
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    # What a SIGKILL mid-part leaves (tests/test_shard_resume.py makes it for real): shard-a's second part never
    # linked, its rows journalled done and pointing at it, its temp file hidden; no part record, no _meta.json.
    unfinished = out / "shards" / f"shard-a-00001{SUFFIX[fmt]}"
    finished = out / "shards" / f"shard-a-00000{SUFFIX[fmt]}"
    unfinished.unlink()
    (out / "ledger/parts" / f"{unfinished.name}.json").unlink()
    (out / META_JSON).unlink()
    (out / "ledger/shard-a.jsonl").rename(out / "ledger/shard-a.journal.jsonl")
    temp = unfinished.with_name(f".{unfinished.name}.0123456789ab{TEMP_SUFFIX}")
    temp.write_bytes(b"PAR1 half a part")
    before = finished.stat()
    points = tmp_path / "points.log"
    monkeypatch.setenv(LOG_ENV, str(points))

    ok, result = run_build(shard_config(source, tiny_model, out, fmt, "wan22", workers=1))
    assert ok, result
    assert (result["done"], result["reused"], result["encoded"]) == (SAMPLES, SAMPLES - 1, 1)
    assert points.read_text().split().count("decode") == 2  # the sanity sample, and the one in the lost part
    after = finished.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), "a finished part was rewritten"
    assert not temp.exists() and not list(out.rglob(f"*{TEMP_SUFFIX}"))
    wanted = {k: v for k, v in tree_hashes(reference).items() if k.startswith(("shards/", "ledger/parts/"))}
    assert wanted == {k: v for k, v in tree_hashes(out).items() if k.startswith(("shards/", "ledger/parts/"))}
    assert (out / META_JSON).read_bytes() == (reference / META_JSON).read_bytes()


def test_parquet_has_no_column_for_audio_and_says_so_before_anything_runs(source, ltx2_model, tmp_path):
    cfg = shard_config(source, ltx2_model, tmp_path / "out", "parquet", "ltx2", audio=True)
    with pytest.raises(
        ConfigError, match=r"format parquet with family ltx2: FastVideo.s pyarrow_schema_t2v has no audio column"
    ):
        make_spec(cfg)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_existing_and_decode_and_verify_read_samples_inside_shards(builds, source, tiny_model, tmp_path, fmt):
    out = builds(fmt, "wan22")
    report = verified(make_plan(shard_config(source, tiny_model, out, fmt, "wan22")))
    assert report.kind == "compatible" and report.problems == [] and len(report.checked) == SAMPLES
    assert report.outputs == {"latents": "present", "text_embeddings": "present"}
    assert report.bytes == sum(p.stat().st_size for p in _parts(out))  # each shard file counted once
    decoded = decode_and_verify(out, n=2, device="cpu", report_dir=tmp_path / "decode")
    assert len(decoded.rows) == 2 and not decoded.problems


def test_the_reader_of_a_cache_streams_only_the_samples_its_ledger_names(builds, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(builds("webdataset", "wan22"), out)
    sealed = out / "ledger/shard-a.jsonl"
    lines = sealed.read_text().splitlines(keepends=True)
    superseded = json.loads(lines[0])["member"]
    sealed.write_text("".join(lines[1:]))  # as if its row now named a newer copy elsewhere
    keys = [s["__key__"] for s in stream_samples(out)]
    assert len(keys) == SAMPLES - 1 and superseded not in keys
    assert len(list(stream_samples(_parts(out)))) == SAMPLES  # files given one by one: every member


@pytest.mark.parametrize("fmt", FORMATS)
def test_flipped_bytes_in_a_part_are_found_and_the_printed_repair_reencodes_its_samples(
    builds, source, tiny_model, tmp_path, fmt
):
    """A part is checked against its part record (its sha256 when it was linked into place): 64 bytes flipped,
    same size, make every sample of that part damaged; the printed repair moves the part out of OUT and the build
    run again encodes those samples into a part again."""
    out = tmp_path / "copy"
    shutil.copytree(builds(fmt, "wan22"), out)
    cfg = shard_config(source, tiny_model, out, fmt, "wan22")
    part = _parts(out)[0]
    data = bytearray(part.read_bytes())
    data[-400:-336] = bytes(b ^ 0xFF for b in data[-400:-336])
    part.write_bytes(bytes(data))
    in_part = sorted(r.key for r in _done(out) if r.path == f"shards/{part.name}")
    report = verified(make_plan(cfg), content="all")
    assert report.kind == "damaged" and sorted(d["key"] for d in report.damaged) == in_part
    assert all("is not its record's" in d["why"] for d in report.damaged)
    assert reconciled(make_plan(cfg), content=True).reasons() == {"file_damaged": len(in_part)}
    for line in report.repair:
        subprocess.run(["bash", "-c", line], check=True)
    ok, result = run_build(cfg)
    assert ok and (result["encoded"], result["reused"]) == (len(in_part), SAMPLES - len(in_part)), result
    again = verified(make_plan(cfg), content="all")
    assert again.kind == "compatible" and again.damaged == [] and reconciled(make_plan(cfg), content=True).ok
