"""A tar's listing records are latentforge's own, read back: never trusted (issue 53, item 1; DESIGN, invariant 10).

`Source.relisted` makes a tar's samples from records of its listing (the plan's spool, this machine's kept listing)
without reading the headers again. Whatever the records say (swapped between samples, renamed, cut, inflated,
re-nested, pointing outside the tar), a sample read from them gives its own member's bytes or a ``not_in_shard``
row, never another sample's bytes, and never a Python error; a kept listing that the spot check refutes is listed
again; a build from a store whose kept listing was altered makes the bytes of an uninterrupted build."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import tarfile
from pathlib import Path
from typing import Any

import boto3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from flows.cli import app
from infra.errors import InputError
from infra.plan import recorded_shards
from infra.sources import ahead, listing_cache, open_source
from infra.sources.relist import NOT_IN_SHARD, NotAsListed
from tests.conftest import make_shards, sample, tree_hashes
from tests.media_utils import cut_clip
from tests.s3_proxy import module_s3

SAMPLES = 4
BUCKET = "lf-proof"
s3 = module_s3(BUCKET, "AKIDPROOFTEST", "proof-secret-never-written")


def _prompt(i: int) -> bytes:
    return b"the prompt of sample %d, and only of it" % i


@pytest.fixture(scope="module")
def tar_root(tmp_path_factory: pytest.TempPathFactory, clips: dict[str, bytes]) -> Path:
    """One VBVR tar of `SAMPLES` samples whose videos all differ (another clip or another length each)."""
    videos = [cut_clip(clips[name], frames, width=96) for name in ("carphone", "bikes") for frames in (5, 6)]
    samples = [sample(0, i, videos[i], _prompt(i)) for i in range(SAMPLES)]
    return make_shards(tmp_path_factory.mktemp("proof-src"), {"part": samples})


def _truth(root: Path) -> dict[str, dict[str, bytes]]:
    """Each sample directory's members' bytes, read with tarfile itself."""
    found: dict[str, dict[str, bytes]] = {}
    with tarfile.open(root / "part.tar") as tf:
        for info in tf:
            if info.isfile():
                directory, _, name = info.name.rpartition("/")
                found.setdefault(directory, {})[name] = tf.extractfile(info).read()  # type: ignore[union-attr]
    return found


def _records(root: Path) -> list[Any]:
    source = open_source(f"vbvr:{root}")
    return [ref.listed for ref in source.samples(source.shards()[0])]


def _read_all(root: Path, records: list[Any], spot: bool = False) -> dict[str, Any]:
    """Each ref `relisted` makes from `records`: key → (prompt, video) bytes, or the InputError's reason."""
    source = open_source(f"vbvr:{root}")
    shard = source.shards()[0]
    read: dict[str, Any] = {}
    for ref in source.relisted(shard, iter(records), spot=spot):
        try:
            read[ref.key] = ref.read_together() if ref.read_together else (ref.read_prompt(), ref.read_media())
        except InputError as exc:
            read[ref.key] = exc.reason
    return read


def _assert_own_bytes(read: dict[str, Any], truth: dict[str, dict[str, bytes]]) -> None:
    """Every sample read gives its own members' bytes (or is refused not_in_shard); every real sample is read."""
    for key, got in read.items():
        if got == NOT_IN_SHARD:
            assert key not in truth, f"{key} is in the tar but was refused"
            continue
        assert not isinstance(got, str), (key, got)
        prompt, video = got
        assert key in truth, f"{key} read bytes although the tar holds no such sample"
        assert prompt == truth[key]["prompt.txt"] and video == truth[key]["ground_truth.mp4"], key
    assert set(truth) <= {k for k, v in read.items() if v != NOT_IN_SHARD}, "a sample of the tar was not made"


def test_records_as_listed_read_their_own_bytes_with_no_extra_read(tar_root: Path) -> None:
    truth = _truth(tar_root)
    read = _read_all(tar_root, _records(tar_root), spot=True)
    _assert_own_bytes(read, truth)
    assert list(read) == list(truth)  # in the tar's order, nothing added


def test_video_records_swapped_between_two_samples_read_each_samples_own_bytes(tar_root: Path, caplog) -> None:
    """The attack of issue 53: the kept listing's records altered so that sample 0 points at sample 1's video. Read
    as recorded, sample 0 would have been made from sample 1's bytes and recorded done."""
    records = _records(tar_root)
    records[0][1], records[1][1] = records[1][1], records[0][1]
    read = _read_all(tar_root, records)
    _assert_own_bytes(read, _truth(tar_root))
    assert "not what the tar holds" in caplog.text


def test_a_renamed_record_is_refused_and_the_sample_it_hid_is_still_made(tar_root: Path) -> None:
    records = _records(tar_root)
    phantom = records[2][0] = records[2][0][:-1] + "9"  # a sample the tar does not hold
    read = _read_all(tar_root, records)
    assert read[phantom] == NOT_IN_SHARD
    _assert_own_bytes(read, _truth(tar_root))


def test_a_record_that_says_a_member_is_absent_is_confirmed_by_the_tar(tar_root: Path) -> None:
    records = _records(tar_root)
    records[1][1] = None  # "no video": a record cannot prove an absence
    _assert_own_bytes(_read_all(tar_root, records), _truth(tar_root))


def test_the_spot_check_refutes_a_listing_of_another_tar(tar_root: Path, tmp_path: Path, clips) -> None:
    """A kept listing whose every record points elsewhere (another tar's listing under this tar's name) is refused
    before any sample is made from it."""
    records = _records(tar_root)
    for record in records:  # every member's header offset one block off: no record proves
        for member in record[1:3]:
            member[5] += 512
            member[0] += 512
    with pytest.raises(NotAsListed):
        _read_all(tar_root, records, spot=True)


#: One corruption of a listing's records: what it does to a deep copy of them.
CORRUPTIONS = {
    "swap_members": lambda r, i, j: r[i].__setitem__(1, r[j][1]),
    "swap_prompts": lambda r, i, j: r[i].__setitem__(2, r[j][2]),
    "swap_directories": lambda r, i, j: r[i].__setitem__(0, r[j][0]),
    "rename": lambda r, i, j: r[i].__setitem__(0, r[i][0][:-1] + "9"),
    "offset_past_end": lambda r, i, j: r[i][1].__setitem__(0, 1 << 40),
    "negative_size": lambda r, i, j: r[i][1].__setitem__(1, -5),
    "inflate_size": lambda r, i, j: r[i][1].__setitem__(1, r[i][1][1] * 1000 + 1),
    "shift_both": lambda r, i, j: (r[i][1].__setitem__(0, r[j][1][0]), r[i][1].__setitem__(5, r[j][1][5])),
    "re_nest": lambda r, i, j: r.__setitem__(i, [[[[r[i]]]]]),
    "wrong_type": lambda r, i, j: r[i][1].__setitem__(2, "yesterday"),
    "cut": lambda r, i, j: r.__setitem__(i, r[i][:2]),
    "drop": lambda r, i, j: r.pop(i),
    "duplicate": lambda r, i, j: r.insert(i, copy.deepcopy(r[j])),
    "null_member": lambda r, i, j: r[i].__setitem__(1, None),
    "old_format": lambda r, i, j: r[i][1].pop(),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.sampled_from(sorted(CORRUPTIONS)), st.integers(0, SAMPLES - 1), st.integers(0, SAMPLES - 1)),
        min_size=1,
        max_size=3,
    ),
    st.booleans(),
)
def test_any_corruption_of_the_records_never_reads_another_samples_bytes(
    tar_root: Path, corruptions: list[tuple[str, int, int]], spot: bool
) -> None:
    truth = _truth(tar_root)
    records = _records(tar_root)
    for name, i, j in corruptions:
        if i < len(records) and j < len(records):
            try:
                CORRUPTIONS[name](records, i, j)
            except (TypeError, AttributeError, IndexError):  # one corruption undid another's shape: leave it
                continue
    try:
        read = _read_all(tar_root, records, spot=spot)
    except NotAsListed:
        assert spot  # refused before a sample was made: the plan lists the tar again
        return
    for key, got in read.items():  # a sample read gives its own bytes; a duplicate key is one sample twice
        if got != NOT_IN_SHARD and not isinstance(got, str):
            assert key in truth and got == (truth[key]["prompt.txt"], truth[key]["ground_truth.mp4"]), key
        assert got != NOT_IN_SHARD or key not in truth, key
    if not any(name == "drop" for name, _, _ in corruptions):  # a record left out is the kept digest's to catch
        assert set(truth) <= set(read), "a sample of the tar was not made"


# --- a build from a store whose kept listing was altered ---------------------------------------------------------


@pytest.fixture(scope="module")
def store_source(s3, tar_root: Path) -> str:
    boto3.client("s3", endpoint_url=s3.direct).put_object(
        Bucket=BUCKET, Key="src/part.tar", Body=(tar_root / "part.tar").read_bytes()
    )
    return f"vbvr:s3://{BUCKET}/src"


def _build(source: str, model: Path, out: Path) -> Any:
    args = ["build", "--source", source, "--model", str(model), "--out", str(out), "--device", "cpu"]
    args += ["--dtype", "fp32", "--frames", "5", "--height", "32", "--width", "32", "--decode-samples", "0"]
    return CliRunner().invoke(app, args)


def _rewrite_entry(path: Path, alter: Any) -> None:
    """Alter a kept listing's records and write its first line anew (its digest matching): an attacker's edit."""
    head, *lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    alter(records)
    body = [json.dumps(r) for r in records]
    meta = json.loads(head) | {"samples": len(body), "sha256": hashlib.sha256("\n".join(body).encode()).hexdigest()}
    path.write_text("\n".join([json.dumps(meta), *body]) + "\n")


@pytest.mark.slow
def test_a_build_from_an_altered_kept_listing_makes_each_sample_from_its_own_bytes(
    s3, store_source, tiny_model, tmp_path, monkeypatch
):
    """Before: a kept listing whose records pointed sample 0 at sample 1's video built sample 0 from sample 1's bytes,
    recorded done, exit 0. Now the build ends with every sample done and the bytes of a build from a fresh listing;
    the altered entry is dropped, and the next plan keeps the tar's listing anew."""
    monkeypatch.setenv("LATENTFORGE_CACHE_DIR", str(tmp_path / "machine"))
    first = _build(store_source, tiny_model, tmp_path / "first")
    assert first.exit_code == 0, first.output
    (entry,) = (tmp_path / "machine" / listing_cache.FOLDER).glob("*.jsonl")

    def swap(records: list[Any]) -> None:
        records[0][1], records[1][1] = records[1][1], records[0][1]
        records[2][2], records[3][2] = records[3][2], records[2][2]

    _rewrite_entry(entry, swap)
    second = _build(store_source, tiny_model, tmp_path / "second")
    assert second.exit_code == 0, second.output
    reference = {k: v for k, v in tree_hashes(tmp_path / "first").items() if k.endswith(".pt")}
    again = {k: v for k, v in tree_hashes(tmp_path / "second").items() if k.endswith(".pt")}
    assert len(reference) == SAMPLES and again == reference
    assert not _entry_altered(entry)  # dropped (the next plan lists the tar and keeps it anew)
    third = _build(store_source, tiny_model, tmp_path / "third")
    assert third.exit_code == 0, third.output
    assert entry.is_file() and not _entry_altered(entry)


def _entry_altered(entry: Path) -> bool:
    """Whether the kept entry (if there) still holds the altered records (sample 0's video at sample 1's offset)."""
    if not entry.is_file():
        return False
    records = [json.loads(line) for line in entry.read_text().splitlines()[1:]]
    return records[0][1][0] > records[1][1][0]


def test_ahead_lists_a_tar_again_when_its_kept_listing_is_not_borne_out(s3, store_source, tmp_path, monkeypatch):
    """The plan's use of a kept listing: refuted by its spot check (every record off by a block) → the tar listed
    again from its headers, the entry dropped and kept anew, the samples those of the tar."""
    monkeypatch.setenv("LATENTFORGE_CACHE_DIR", str(tmp_path / "machine"))
    source = open_source(store_source)
    shard = source.shards()[0]
    listed = ahead.list_shard(source, shard, None)
    entry = listing_cache.entry(shard)
    assert entry is not None and entry.is_file()

    def shift(records: list[Any]) -> None:
        for record in records:
            for member in record[1:3]:
                member[0] += 512
                member[5] += 512

    _rewrite_entry(entry, shift)
    again = ahead.list_shard(source, shard, None)
    assert [r.key for r in again.refs] == [r.key for r in listed.refs]
    assert [r.listed for r in again.refs] == [r.listed for r in listed.refs]
    assert listing_cache.cached(shard) == [r.listed for r in listed.refs]  # kept anew, as the tar says


# --- the recorded plan names a shard outside the source ----------------------------------------------------------


class _Caught(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_recorded_plan_naming_a_tar_outside_the_source_is_never_read(tar_root, tiny_model, tmp_path, clips):
    """Before: OUT/ledger/plan.json edited to add a shard at a tar outside the source made the resume (the same
    command) read that tar and write its samples, and `reconcile` list it. Now the entry is left out with one
    warning line naming plan.json: nothing of that tar is read or written, the resume and reconcile end clean."""
    video = cut_clip(clips["carphone"], 5, width=96)
    outside = make_shards(tmp_path / "elsewhere", {"evil": [sample(1, 7, video, b"not the user's")]})
    out = tmp_path / "out"
    source = f"vbvr:{tar_root}"
    assert _build(source, tiny_model, out).exit_code == 0
    index = out / "ledger" / "plan.json"
    plan = json.loads(index.read_text())
    entry = dict(
        plan["shards"][0], id="evil", path=str(outside / "evil.tar"), size=(outside / "evil.tar").stat().st_size
    )
    entry["mtime_ns"] = (outside / "evil.tar").stat().st_mtime_ns
    plan["shards"].append(entry)
    index.write_text(json.dumps(plan))
    key = open_source(f"vbvr:{outside}").samples(open_source(f"vbvr:{outside}").shards()[0])
    evil_key = next(iter(key)).key
    (out / "ledger" / "plan" / "evil.jsonl").write_text(json.dumps([evil_key, "x_00000007", "g"]) + "\n")
    before = tree_hashes(out)

    again = _build(source, tiny_model, out)
    assert again.exit_code == 0, again.output
    after = tree_hashes(out)
    assert not [k for k in after if "evil" in k and k not in before], sorted(after)  # no ledger, no sample of it
    assert not any(v != before.get(k) for k, v in after.items() if k.endswith(".pt"))
    assert "evil" not in index.read_text()  # the resume recorded its plan without it
    index.write_text(json.dumps(plan))
    caught = _Caught()
    logging.getLogger("infra.plan").addHandler(caught)  # the build's Prefect logging took the root's handlers
    try:
        shards = recorded_shards(out, source)
    finally:
        logging.getLogger("infra.plan").removeHandler(caught)
    assert shards is not None and [s.id for s in shards] == ["part"]
    assert "plan.json: shard evil is not read and left out of the recorded plan" in "\n".join(caught.lines)
    checked = CliRunner().invoke(app, ["reconcile", str(out), "--model", str(tiny_model)])
    assert checked.exit_code == 0, checked.output
