"""The verbs on a cache whose OUT is a URL (``s3://`` on the loopback moto behind the counting proxy), each through
the command line or the flow a user runs: verify-existing and its approval, reconcile, decode-and-verify, `inspect`,
the audio gate, `stream_samples`, the shard formats, upload to the (loopback) Hub; a store that refuses writes stops
the run with one line; no credential in any byte the module's runs wrote.

One S3 cache is built for the module (two clips, one shard) and the verbs run on it; a test that changes a cache
works on a server-side copy of it."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
import torch
from click.testing import Result
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra import outdir
from infra.cache.cachedir import CACHE_JSON, PENDING_JSON
from infra.cache.lock import LOCK_NAME
from infra.errors import OutNotWritable, exit_code
from infra.formats.stream import stream_samples
from infra.gates.conflicts import overwrite_token
from infra.outstore import StoreOut
from tests.conftest import FRAMES, HEIGHT, WIDTH, assert_same_cache, config, make_shards, sample, tree_files
from tests.fakehub import FakeHub
from tests.media_utils import cut_clip, trainer_dataset
from tests.s3_proxy import LoopbackS3, module_s3

ACCESS_KEY, SECRET_KEY = "AKIDVERBSTESTKEY", "verbs-secret-never-written"
HF_TOKEN = "hf_verbsTokenNeverWritten0123456789"
BUCKET, REPO = "lf-verbs", "latentforge-test/s3-cache"
URL = f"s3://{BUCKET}/cache"
SAMPLES = 2
runner = CliRunner()


s3 = module_s3(BUCKET, ACCESS_KEY, SECRET_KEY)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the module's runs keep local files: the temporary files (the plan's spool), HF_HOME."""
    return tmp_path_factory.mktemp("verbs-local")


@pytest.fixture(scope="module")
def hub(local: Path) -> Iterator[FakeHub]:
    """The loopback Hub, refusing any token but the module's, and huggingface_hub aimed at it for every run of the
    module (the token is in the environment of the builds too: no byte they write may hold it); this process's
    temporary files under `local`."""
    import huggingface_hub.constants as hf_constants  # noqa: PLC0415 - after the env is set

    fake = FakeHub(token=HF_TOKEN)
    fake.start()
    (local / "tmp").mkdir()
    env = {"HF_ENDPOINT": fake.url, "HF_TOKEN": HF_TOKEN, "HF_HOME": str(local / "hf-home")}
    env |= {"HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "127.0.0.1,localhost"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        patch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
        patch.setattr(hf_constants, "HF_HUB_DISABLE_TELEMETRY", True)
        patch.setattr(tempfile, "tempdir", str(local / "tmp"))  # the documented override of gettempdir()
        yield fake
    fake.stop()


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory, clips: dict[str, bytes]) -> Path:
    root = tmp_path_factory.mktemp("verbs-src")
    video = cut_clip(clips["carphone"], 6)
    return make_shards(root, {"part-00000": [sample(0, i, video, b"clip %d" % i) for i in range(SAMPLES)]})


@pytest.fixture(scope="module")
def built(s3: LoopbackS3, hub: FakeHub, shards: Path, tiny_model: Path) -> dict:
    """The module's S3 cache, its build's decode-and-verify on one sample (its strips written to the store)."""
    ok, result = run_build(config(shards, tiny_model, URL, workers=1, decode_samples=1))  # type: ignore[arg-type]
    assert ok, result
    return result


def _copy(s3: LoopbackS3, to: str) -> str:
    """A server-side copy of the module's cache under ``s3://BUCKET/<to>``; its URL."""
    client = boto3.client("s3", endpoint_url=s3.direct)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="cache/"):
        for item in page.get("Contents", []):
            key = f"{to}/{item['Key'].removeprefix('cache/')}"
            client.copy_object(Bucket=BUCKET, Key=key, CopySource={"Bucket": BUCKET, "Key": item["Key"]})
    return f"s3://{BUCKET}/{to}"


def _reports(s3: LoopbackS3, prefix: str) -> list[str]:
    client = boto3.client("s3", endpoint_url=s3.direct)
    found = client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/reports/").get("Contents", [])
    return sorted(item["Key"].removeprefix(f"{prefix}/") for item in found)


def test_verify_reads_every_object_and_names_a_damaged_one(s3, built):
    clean = runner.invoke(app, ["verify", URL])
    assert clean.exit_code == 0, clean.output
    assert f"COMPATIBLE — {URL} holds this cache, {SAMPLES} sample(s) done" in clean.stdout, clean.stdout
    damaged = _copy(s3, "damaged")
    sample_key = next(k for k in s3.objects(BUCKET, "damaged") if k.endswith(".pt"))
    boto3.client("s3", endpoint_url=s3.direct).put_object(Bucket=BUCKET, Key=f"damaged/{sample_key}", Body=b"bad")
    found = runner.invoke(app, ["verify", damaged])
    assert found.exit_code == 1 and sample_key in found.stdout, found.output


def test_changed_settings_stop_at_the_approval_and_overwrite_nothing(s3, built, shards, tiny_model):
    url = _copy(s3, "conflict")
    before = s3.objects(BUCKET, "conflict")
    changed = config(shards, tiny_model, url, workers=1, text_padding="zeros")  # type: ignore[arg-type]
    ok, message = run_build(changed)
    assert not ok and "--approve-overwrite" in str(message), message
    assert s3.objects(BUCKET, "conflict") == before  # nothing written, not even a lock left
    old = json.loads(before["cache.json"])["fingerprint"]
    from infra.plan import make_plan  # noqa: PLC0415 - the planned fingerprint, as the gate computes it

    token = overwrite_token(StoreOut.of(url), old, make_plan(changed).fingerprint)
    assert token in str(message)
    s3.proxy.reset()
    ok, result = run_build(changed.with_values(approve_overwrite=token))
    assert ok, result
    after = s3.objects(BUCKET, "conflict")
    assert after[f"cache.{old[:16]}.json"] == before["cache.json"]  # the old cache.json kept beside the new one
    assert json.loads(after["cache.json"])["fingerprint"] != old and result["encoded"] == SAMPLES
    # the new cache.json is put last, once, as a fresh build's: after every sample (the pending copy meanwhile)
    start = f"/{BUCKET}/conflict/"
    puts = [p.split("?")[0][len(start) :] for kind, p in s3.proxy.requests if kind == "PUT" and start in p]
    puts = [rel for rel in puts if rel != LOCK_NAME and not rel.startswith("reports/")]
    assert puts[-1] == CACHE_JSON and puts.count(CACHE_JSON) == 1 and PENDING_JSON in puts, puts
    assert PENDING_JSON not in after


def test_a_changed_source_stops_at_the_stale_approval_and_replace_rewrites_only_its_sample(
    s3, built, clips, tiny_model, tmp_path
):
    """One prompt revised upstream: the build stops at the stale gate with nothing written; approved (--on-stale
    replace), only that sample's object is put again."""
    url = _copy(s3, "stale")
    before = s3.objects(BUCKET, "stale")
    video = cut_clip(clips["carphone"], 6)
    revised = make_shards(
        tmp_path, {"part-00000": [sample(0, 0, video, b"clip 0, revised"), sample(0, 1, video, b"clip 1")]}
    )
    ok, refused = run_build(config(revised, tiny_model, url, workers=1))  # type: ignore[arg-type]
    assert not ok and "changed in the source" in str(refused), refused
    assert s3.objects(BUCKET, "stale") == before
    ok, result = run_build(config(revised, tiny_model, url, workers=1, on_stale="replace"))  # type: ignore[arg-type]
    assert ok and (result["encoded"], result["reused"]) == (1, 1), result
    after = s3.objects(BUCKET, "stale")
    changed = [k for k in before if k.endswith(".pt") and after[k] != before[k]]
    assert changed == [next(k for k in before if k.endswith("_00000000.pt"))], changed


def test_reconcile_counts_the_store_and_names_a_lost_sample(s3, built):
    ok = runner.invoke(app, ["reconcile", URL])
    assert ok.exit_code == 0 and f"OK ({SAMPLES} of {SAMPLES} expected" in ok.stdout, ok.output
    assert any(k.startswith("reports/reconcile-") for k in _reports(s3, "cache"))  # its report written to the store
    url = _copy(s3, "lost")
    sample_key = next(k for k in s3.objects(BUCKET, "lost") if k.endswith(".pt"))
    boto3.client("s3", endpoint_url=s3.direct).delete_object(Bucket=BUCKET, Key=f"lost/{sample_key}")
    short = runner.invoke(app, ["reconcile", url])
    assert short.exit_code == 1 and "SHORTFALL 1" in short.stdout, short.output


def test_decode_and_verify_writes_its_strips_to_the_store(s3, built):
    assert built["decode_strips"] and all(p.startswith(f"{URL}/reports/decode/") for p in built["decode_strips"])
    # on a copy: the module's cache is what the other tests read and publish
    url = _copy(s3, "decoded")
    result = runner.invoke(app, ["decode", url, "--decode-samples", "1"])
    assert result.exit_code == 0 and "1 sample(s), mean PSNR" in result.stdout, result.output
    strips = [k for k in _reports(s3, "decoded") if k.startswith("reports/decode/") and k.endswith(".png")]
    assert len(strips) == 2, strips  # the build's, and the command's in a new stamped folder beside it


def test_inspect_counts_the_store(s3, built):
    result = runner.invoke(app, ["inspect", URL, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    cache = json.loads(s3.objects(BUCKET, "cache")["cache.json"])
    assert (report["out"], report["fingerprint"], report["done"]) == (URL, cache["fingerprint"], SAMPLES), report
    (one,) = report["samples"].values()  # one sample per group, loaded from the store
    assert one["x0"]["shape"] == [48, 5, 3, 5] and report["bytes"] > 0, one
    assert report["unfinished"] is False and "unfinished" not in runner.invoke(app, ["inspect", URL]).stdout


def test_inspect_says_a_store_out_without_cache_json_is_unfinished(s3, built):
    """A store OUT whose run has not ended (or stopped before it did) holds the pending spec, no cache.json: inspect
    reads it and says so, in its text and its JSON."""
    url = _copy(s3, "unfinished")
    client = boto3.client("s3", endpoint_url=s3.direct)
    pending = {"Bucket": BUCKET, "Key": f"unfinished/{CACHE_JSON}"}
    client.copy_object(Bucket=BUCKET, Key=f"unfinished/{PENDING_JSON}", CopySource=pending)
    client.delete_object(**pending)
    text = runner.invoke(app, ["inspect", url])
    assert text.exit_code == 0, text.output
    line = next((ln for ln in text.stdout.splitlines() if ln.startswith("unfinished")), "")
    assert "no cache.json yet" in line and "the same build command finishes it" in line, text.stdout
    report = json.loads(runner.invoke(app, ["inspect", url, "--json"]).stdout)
    assert report["unfinished"] is True and report["done"] == SAMPLES, report


def test_a_webdataset_cache_on_the_store_is_the_local_one_and_streams_the_same(s3, shards, tiny_model, tmp_path):
    """A shard format on a store (parts written through a spooled sink, then put once each): the objects are the
    files of the same build local, and `stream_samples` reads the store's parts as it reads the local ones."""
    local = tmp_path / "local"
    ok, result = run_build(config(shards, tiny_model, local, workers=1, format="webdataset"))
    assert ok, result
    url = f"s3://{BUCKET}/webdataset"
    ok, result = run_build(config(shards, tiny_model, url, workers=1, format="webdataset"))  # type: ignore[arg-type]
    assert ok, result
    assert_same_cache(s3.objects(BUCKET, "webdataset"), tree_files(local))
    ours, theirs = list(stream_samples(url)), list(stream_samples(local))
    assert len(ours) == SAMPLES and [s["__key__"] for s in ours] == [s["__key__"] for s in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a["latents"], b["latents"]) and a["__url__"].startswith(f"{url}/shards/")
    assert a["consumer"] == b["consumer"] != {}  # read from the store's cache.json


def test_a_fastvideo_parquet_cache_on_the_store_verifies_and_streams(s3, shards, tiny_model):
    url = f"s3://{BUCKET}/parquet"
    ok, result = run_build(config(shards, tiny_model, url, workers=1, format="parquet"))  # type: ignore[arg-type]
    assert ok, result
    parts = [k for k in s3.objects(BUCKET, "parquet") if k.startswith("shards/")]
    assert parts and all(k.endswith(".parquet") for k in parts), parts
    verified = runner.invoke(app, ["verify", url])  # every part's sha256 against its record
    assert verified.exit_code == 0, verified.output
    streamed = list(stream_samples(f"{url}/{parts[0]}"))  # one part, named by its URL
    assert len(streamed) == SAMPLES and all(s["latents"].isfinite().all() for s in streamed)


def test_the_audio_gate_on_an_ltx2_cache_in_the_store(s3, ltx2_model, tmp_path):
    """An LTX-2 build with audio to the store: the build's audio gate passes on the store's objects, and
    `audio-check` loads every audio latent from the store and names the clip without a track."""
    dataset = trainer_dataset(tmp_path / "data", {"bigbuckbunny": "a grey rabbit wakes up", "bikes": "cyclists"})
    url = f"s3://{BUCKET}/ltx2"
    values = {"source": f"meta:{dataset}", "format": "ltx", "audio": True, "buckets": "96x64x9", "workers": 1}
    ok, result = run_build(config(dataset.parent, ltx2_model, url, **values))  # type: ignore[arg-type]
    assert ok, result
    audio = [k for k in s3.objects(BUCKET, "ltx2") if k.startswith(".precomputed/audio_latents/")]
    assert audio == [".precomputed/audio_latents/clips/bigbuckbunny.pt"], audio
    checked = runner.invoke(app, ["audio-check", url, "--json"])
    assert checked.exit_code == 0, checked.output
    report = json.loads(checked.stdout)
    assert (report["audio_run"], report["with_audio"], report["unreadable"]) == (True, 1, []), report
    assert [(n["id"], n["reason"]) for n in report["without"]] == [("clips/bikes.mp4", "no_audio_track")], report


@pytest.fixture(scope="module")
def published(s3: LoopbackS3, built: dict, hub: FakeHub) -> Result:
    """`latentforge upload s3://... --to hf://...` of the module's cache (its token the module's), with a second
    object of one strip's bytes beside it (two files of one content in one commit: one LFS upload, two paths)."""
    client = boto3.client("s3", endpoint_url=s3.direct)
    strip = built["decode_strips"][0].removeprefix(f"s3://{BUCKET}/")
    client.copy_object(
        Bucket=BUCKET, Key="cache/reports/decode/same-bytes.png", CopySource={"Bucket": BUCKET, "Key": strip}
    )
    return runner.invoke(app, ["upload", URL, "--to", f"hf://datasets/{REPO}", "--license", "cc-by-4.0"])


def test_an_s3_cache_is_published_to_the_hub(s3, hub, published):
    """The Hub gets the store's objects (but the upload's private state and the recorded plan), byte for byte, with
    its card; the remote check passes."""
    result = published
    assert result.exit_code == 0, result.output
    assert "remote verified: " in result.stdout, result.output
    client = boto3.client("s3", endpoint_url=s3.direct)
    listed = [i["Key"] for i in client.list_objects_v2(Bucket=BUCKET, Prefix="cache/")["Contents"]]
    stored = {k.removeprefix("cache/"): client.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in listed}
    sent = {k: v for k, v in stored.items() if not k.startswith(("reports/upload-", ".latentforge", "ledger/plan"))}
    files = hub.files(REPO)
    assert {k: v for k, v in files.items() if k not in (".gitattributes", "README.md")} == sent
    assert b"license: cc-by-4.0" in files["README.md"]
    assert any(k.startswith("reports/upload-") for k in stored)  # its report written to the store


def _one_error_line(result: Result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


def _build_args(shards: Path, model: Path, out: str) -> list[str]:
    geometry = ["--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH)]
    return ["build", "--source", f"vbvr:{shards}", "--model", str(model), "--out", out, *geometry, "--device", "cpu"]


def test_a_bucket_that_does_not_exist_stops_the_build_with_one_line(s3, shards, tiny_model):
    url = "s3://lf-no-such-bucket/cache"
    result = runner.invoke(app, _build_args(shards, tiny_model, url))
    line = _one_error_line(result)
    assert result.exit_code == exit_code(OutNotWritable("", "")), result.output
    assert url in line and "NoSuchBucket" in line, line


def test_a_store_that_refuses_writes_stops_the_build_at_once_with_one_line(s3, shards, tiny_model):
    """No permission to write (403 to every PUT and DELETE, reads allowed): the run stops at its first write, the
    lock, before a sample is encoded; one line names the object and the store's reason."""
    s3.proxy.refuse_writes = ""
    s3.proxy.reset()
    try:
        result = runner.invoke(app, _build_args(shards, tiny_model, f"s3://{BUCKET}/refused"))
    finally:
        s3.proxy.refuse_writes = None
    line = _one_error_line(result)
    assert result.exit_code == exit_code(OutNotWritable("", "")), result.output
    assert f"s3://{BUCKET}/refused/.latentforge.lock" in line and "AccessDenied" in line, line
    assert s3.proxy.counts["REFUSED"] == 1 and s3.objects(BUCKET, "refused") == {}, dict(s3.proxy.counts)


def test_writes_refused_mid_run_stop_it_at_the_first_sample_with_one_line(s3, shards, tiny_model):
    """The permission lost after the run began (its lock, cache.json and plan written; every sample's PUT refused):
    the run stops at the first sample, not one failed row after another; the lock is released."""
    url = f"s3://{BUCKET}/midrun"
    s3.proxy.refuse_writes = "/midrun/G-"  # the samples' group folders
    s3.proxy.reset()
    try:
        result = runner.invoke(app, _build_args(shards, tiny_model, url))
    finally:
        s3.proxy.refuse_writes = None
    line = _one_error_line(result)
    assert f"{url}/G-11_" in line and "AccessDenied" in line, line
    assert s3.proxy.counts["REFUSED"] == 1, dict(s3.proxy.counts)  # the first sample's, and no other sample tried
    objects = s3.objects(BUCKET, "midrun")
    assert "cache.json" in objects and not any(k.endswith(".pt") for k in objects), sorted(objects)
    assert outdir.lstat(StoreOut.of(url), ".latentforge.lock") is None  # released: the same command resumes


def test_no_credential_in_any_byte_the_runs_wrote(s3, published, hub, local):
    """Issue 40 item 5, after every run of the module (builds, verbs, the upload): the test's access key, secret key
    and Hub token are in no object of the bucket, no file of the Hub, and no local file the runs wrote: the temporary
    files (the plan's spool), HF_HOME, the sanity sample and hash cache ($LATENTFORGE_CACHE_DIR), the Prefect home,
    and the Prefect database (flow runs' parameters, artifacts, logs)."""
    from prefect.settings import PREFECT_HOME, PREFECT_SERVER_DATABASE_CONNECTION_URL  # noqa: PLC0415

    secrets = [s.encode() for s in (ACCESS_KEY, SECRET_KEY, HF_TOKEN)]
    written: dict[str, bytes] = {}
    client = boto3.client("s3", endpoint_url=s3.direct)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for item in page.get("Contents", []):
            written[f"s3://{BUCKET}/{item['Key']}"] = client.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read()
    for repo in hub.repos:
        written |= {f"hf://datasets/{repo}/{path}": data for path, data in hub.files(repo).items()}
    database = Path(PREFECT_SERVER_DATABASE_CONNECTION_URL.value().split("///", 1)[1]).parent
    for root in (local, Path(os.environ["LATENTFORGE_CACHE_DIR"]), PREFECT_HOME.value(), database):
        written |= {str(p): p.read_bytes() for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink()}
    names = " ".join(written)
    for kind in ("/reports/run-", "/reports/upload-", "/ledger/", "README.md", ".sanity/", ".db"):
        assert kind in names, kind  # what the grep must see: reports, ledgers, the card, the sanity, the database
    leaked = {name: [s.decode() for s in secrets if s in data] for name, data in written.items()}
    assert {name: found for name, found in leaked.items() if found} == {}


def test_musubi_asks_for_a_local_out(s3, shards, wan21_model):
    """musubi-tuner reads its cache from the local folder its dataset config names: a URL OUT is refused before a
    byte is written, in one line (it once became a local folder named ``s3:``)."""
    args = _build_args(shards, wan21_model, f"s3://{BUCKET}/musubi")
    result = runner.invoke(app, [*args, "--format", "musubi", "--temporal", "head"])
    line = _one_error_line(result)
    assert result.exit_code == 2 and "musubi-tuner reads its cache from a local folder" in line, result.output
    assert s3.objects(BUCKET, "musubi") == {} and not Path("s3:").exists()


def test_rerun_reads_the_failed_samples_from_the_store(s3, built):
    """`rerun --failed-only` selects what a run left failed from its OUT's ledger: on a store it reads the store's
    ledger (a folded ``s3:/`` path read no ledger and found nothing to rerun). The module's ledger is marked failed
    for the test and put back as it was."""
    run_id = json.loads(outdir.read_text(outdir.root(URL), built["run_report"].removeprefix(URL + "/")))["flow_run_id"]
    client = boto3.client("s3", endpoint_url=s3.direct)
    objects = s3.objects(BUCKET, "cache")
    (key,) = [k for k in objects if k.startswith("ledger/") and k.endswith(".jsonl") and k.count("/") == 1]
    rows = [json.loads(line) for line in objects[key].decode().splitlines()]
    rows[0]["status"], rows[0]["extra"] = "failed", {**rows[0].get("extra", {}), "run_id": run_id}
    client.put_object(Bucket=BUCKET, Key=f"cache/{key}", Body="".join(json.dumps(r) + "\n" for r in rows).encode())
    try:
        dry = runner.invoke(app, ["rerun", run_id, "--failed-only", "--dry-run"])
    finally:
        client.put_object(Bucket=BUCKET, Key=f"cache/{key}", Body=objects[key])
    shard = key.removeprefix("ledger/").removesuffix(".jsonl")
    assert dry.exit_code == 0 and f'["{shard}/{rows[0]["key"]}"]' in dry.output, dry.output


def test_overfit_asks_for_a_local_out(s3, built, tmp_path):
    """The overfit export copies per-sample files from a local OUT: a URL OUT is refused with one line, nothing made."""
    result = runner.invoke(app, ["overfit", URL, "--to", str(tmp_path / "of"), "--n", "1"])
    assert result.exit_code == 2, result.output
    assert "export from a local OUT" in _one_error_line(result) and not (tmp_path / "of").exists()


def test_on_conflict_new_dir_writes_a_new_prefix_beside_the_store_out(s3, built, shards, tiny_model):
    """``--on-conflict new_dir`` on a URL OUT: the changed build goes to ``<OUT>-v2`` (the first prefix with no object
    below it, as OUT-v2 is the first free folder locally); OUT is left as it was."""
    url = _copy(s3, "newdir")
    boto3.client("s3", endpoint_url=s3.direct).put_object(Bucket=BUCKET, Key="newdir-v2/taken", Body=b"x")
    before = s3.objects(BUCKET, "newdir")
    changed = config(shards, tiny_model, url, workers=1, text_padding="zeros", on_conflict="new_dir")  # type: ignore[arg-type]
    ok, result = run_build(changed)
    assert ok and result["out"] == f"{url}-v3" and result["encoded"] == SAMPLES, result
    assert s3.objects(BUCKET, "newdir") == before  # -v2 holds an object: -v3 is the first free prefix
    made = s3.objects(BUCKET, "newdir-v3")
    assert CACHE_JSON in made and PENDING_JSON not in made and StoreOut.of(f"{url}-v3").head(LOCK_NAME) is None
    assert json.loads(made[CACHE_JSON])["fingerprint"] != json.loads(before[CACHE_JSON])["fingerprint"]


def test_a_diffsynth_cache_on_the_store_is_the_local_one(s3, shards, tiny_model, tmp_path):
    """``--format diffsynth`` (a .pth a sample) on a URL OUT: the objects are the files of the same build local."""
    local = tmp_path / "local"
    ok, result = run_build(config(shards, tiny_model, local, workers=1, format="diffsynth", text_padding="zeros"))
    assert ok, result
    url = f"s3://{BUCKET}/diffsynth"
    ok, result = run_build(config(shards, tiny_model, url, workers=1, format="diffsynth", text_padding="zeros"))  # type: ignore[arg-type]
    assert ok and result["done"] == SAMPLES, result
    ours = s3.objects(BUCKET, "diffsynth")
    assert_same_cache(ours, tree_files(local))
    assert len([k for k in ours if k.endswith(".pth")]) == SAMPLES
