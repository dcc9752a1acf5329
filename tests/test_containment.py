"""Nothing is read, written or uploaded outside OUT (issue 38, items 4 and 8), through the commands a user runs:
overfit, upload beside verify, a resumed build with decode-and-verify, a folder source with a linked caption; a
remote README.md a person wrote is replaced only with an approval; and hostile OUT trees that hypothesis generates
leave a watched sibling folder as it was and put nothing of it on the remote."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from flows.cli import app
from flows.terminal_run import run_build
from infra.cache import ledger
from infra.config import EncodingConfig
from infra.errors import InputError, SourceError
from infra.outdir import UnsafePath
from infra.preprocess.read import read
from infra.sources import open_source
from infra.storage import atomic_file, atomic_write
from tests import fakehub, s3_server
from tests.conftest import config, make_shards, sample
from tests.hostile_out import (
    LINKED,
    PAYLOAD,
    ROW_PATHS,
    SECRET,
    Hostile,
    bodies,
    done_rows,
    plant,
    point_row_at,
    rewrite_rows,
    scene,
)
from tests.media_utils import cut_clip

moto_server, s3_env = s3_server.moto_server, s3_server.s3_env  # the fixtures, by name
fake_hub, hub_env = fakehub.fake_hub, fakehub.hub_env
REPO = "latentforge-test/contained"
SAMPLES = 4  # two groups of two


@pytest.fixture(scope="module")
def src(clips: dict[str, bytes], tmp_path_factory: pytest.TempPathFactory) -> Path:
    video = cut_clip(clips["carphone"], 9, width=96)
    samples = [sample(g, i, video, f"group {g}, take {i}".encode()) for g in (0, 1) for i in range(2)]
    return make_shards(tmp_path_factory.mktemp("contain-src"), {"s-00000": samples})


@pytest.fixture(scope="module")
def built(src: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("contain-built") / "out"
    ok, result = run_build(config(src, tiny_model, out, workers=1))
    assert ok and result["done"] == SAMPLES, result
    return out


@pytest.fixture
def bucket(s3_env: str) -> str:
    name = f"lf-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def _cli(*args: object) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args])


def test_overfit_never_follows_a_ledger_path_out_of_out(built: Path, tmp_path: Path) -> None:
    where = scene(built, tmp_path)
    row = done_rows(where.out)[0]
    payload = where.victim / "evil.pt"
    shutil.copy(where.out / row.path, payload)  # a whole sample there: a follower would export a copy beside it
    point_row_at(where, row, str(payload), payload)
    before = where.snapshot()
    answer = _cli("overfit", where.out, "--to", tmp_path / "export", "--ids", f"{row.group}/{row.id}")
    assert answer.exit_code == 1 and "not a path inside OUT" in answer.output, answer.output
    assert where.snapshot() == before and not (tmp_path / "export").exists()


PLANTS = {
    "report-link": lambda w: (w.out / "reports" / "notes.md").symlink_to(w.secret),
    "kept-spec-link": lambda w: (w.out / "cache.old.json").symlink_to(w.secret),
    "ledger-path-up": lambda w: point_row_at(w, done_rows(w.out)[-1], "../victim/secret.txt", w.secret),
}


@pytest.mark.parametrize("plant", PLANTS)
def test_upload_refuses_what_verify_calls_damaged(plant: str, built: Path, tmp_path: Path, bucket: str) -> None:
    where = scene(built, tmp_path)
    PLANTS[plant](where)
    sent = _cli("upload", where.out, "--to", f"s3://{bucket}/c")
    checked = _cli("verify", where.out)
    assert sent.exit_code == 1 and "nothing was uploaded" in sent.output, sent.output
    assert re.search(r"symbolic link|not a path inside OUT", sent.output), sent.output
    assert checked.exit_code == 1 and "damaged" in checked.output.lower(), checked.output
    assert bodies(boto3.client("s3"), bucket, "c/") == {}  # nothing at all, the secret least of all


@pytest.mark.parametrize("folder", ["group", "decode"])
def test_a_resume_never_writes_through_a_linked_folder(
    folder: str, built: Path, src: Path, tiny_model: Path, tmp_path: Path
) -> None:
    where = scene(built, tmp_path)
    if folder == "group":  # a group not encoded yet (a resume encodes it), its folder a link out of OUT
        rows = done_rows(where.out)
        group = rows[-1].group
        rewrite_rows(where.out, rows[-1].shard, {r.key: None for r in rows if r.group == group})
        shutil.rmtree(where.out / group)
        (where.out / group).symlink_to(where.victim, target_is_directory=True)
    else:  # decode-and-verify's folder a link out of OUT
        (where.out / "reports" / "decode").symlink_to(where.victim, target_is_directory=True)
    before = where.snapshot()
    ok, result = run_build(config(src, tiny_model, where.out, workers=1, decode_samples=1))
    assert not ok and "symbolic link" in str(result), result
    assert where.snapshot() == before


def test_a_caption_linked_out_of_a_folder_source_is_skipped_unless_followed(
    clips: dict[str, bytes], tiny_model: Path, tmp_path: Path
) -> None:
    root, secret = tmp_path / "clips", tmp_path / "secret.txt"
    secret.write_bytes(SECRET)
    root.mkdir()
    video = cut_clip(clips["carphone"], 9, width=96)
    for name in ("inside", "outside"):
        (root / f"{name}.mp4").write_bytes(video)
    (root / "captions").mkdir()
    (root / "captions" / "inside.md").write_text("a man talks in a car")
    (root / "inside.txt").symlink_to(root / "captions" / "inside.md")  # a link inside the root: read as ever
    (root / "outside.txt").symlink_to(secret)
    for follow in (False, True):
        out = tmp_path / f"out-{follow}"
        asked = {"follow_symlinks": True} if follow else {}  # the default: not followed
        ok, result = run_build(config(root, tiny_model, out, source=f"folder:{root}", **asked))
        assert ok, result
        rows = {r.id: r for rows in ledger.read_all(out).values() for r in rows.values()}
        prompt = torch.load(out / rows["inside.mp4"].path, weights_only=True)["prompt"]
        assert prompt == "a man talks in a car"
        if follow:  # asked for: the link is read
            assert torch.load(out / rows["outside.mp4"].path, weights_only=True)["prompt"] == SECRET.decode().strip()
        else:
            outside = rows["outside.mp4"]
            assert (outside.status, outside.reason) == ("skipped", "outside_source") and "--follow-symlinks" in (
                outside.detail or ""
            )


def test_meta_paths_and_shard_files_linked_out_of_their_root_are_not_read(src: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "clip.mp4").write_bytes(SECRET)
    (outside / "extra.tar").write_bytes((src / "s-00000.tar").read_bytes())
    data = tmp_path / "data"
    shutil.copytree(src, data)
    (data / "inside.mp4").write_bytes(b"a clip inside the root")
    (data / "linked.mp4").symlink_to(outside / "clip.mp4")
    rows = [{"video": "inside.mp4", "caption": "a"}, {"video": "linked.mp4", "caption": "b"}]
    (data / "list.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    meta = open_source(f"meta:{data / 'list.jsonl'}")
    refs = {ref.id: ref for shard in meta.shards() for ref in meta.samples(shard)}
    assert read(refs["inside.mp4"]).media == b"a clip inside the root"
    with pytest.raises(InputError, match="outside the source root") as refused:
        read(refs["linked.mp4"])
    assert refused.value.reason == "outside_source" and "video" not in refs["linked.mp4"].identity.members
    followed = open_source(f"meta:{data / 'list.jsonl'}", EncodingConfig(follow_symlinks=True))
    assert [read(ref).media for s in followed.shards() for ref in followed.samples(s)][1] == SECRET
    (data / "extra.tar").symlink_to(outside / "extra.tar")  # a shard file linked out of the folder
    with pytest.raises(SourceError, match="outside the source root"):
        open_source(f"vbvr:{data}").shards()
    assert len(open_source(f"vbvr:{data}", EncodingConfig(follow_symlinks=True)).shards()) == 2


HANDWRITTEN = b"# My dataset\n\nWritten by a person, not by latentforge.\n"


def _approve(output: str) -> str:
    found = re.search(r"--approve-replace (\w+)", output)
    assert found, output
    return found[1]


def test_a_readme_a_person_wrote_on_s3_is_replaced_only_with_an_approval(
    built: Path, tmp_path: Path, bucket: str
) -> None:
    out, url, client = Path(shutil.copytree(built, tmp_path / "out")), f"s3://{bucket}/c", boto3.client("s3")

    def readme() -> bytes:
        return client.get_object(Bucket=bucket, Key="c/README.md")["Body"].read()

    assert _cli("upload", out, "--to", url).exit_code == 0
    relicensed = _cli("upload", out, "--to", url, "--license", "mit")  # our own card, unedited: updated in place
    assert relicensed.exit_code == 0 and "updated 1" in relicensed.output and b"license: mit" in readme()
    client.put_object(Bucket=bucket, Key="c/README.md", Body=HANDWRITTEN)
    refused = _cli("upload", out, "--to", url, "--license", "cc-by-4.0", "--on-conflict", "abort")
    assert refused.exit_code == 1 and "README.md" in refused.output and readme() == HANDWRITTEN, refused.output
    approved = _cli("upload", out, "--to", url, "--license", "cc-by-4.0", "--approve-replace", _approve(refused.output))
    assert approved.exit_code == 0 and b"license: cc-by-4.0" in readme(), approved.output


def test_a_readme_a_person_wrote_on_the_hub_is_replaced_only_with_an_approval(
    built: Path, tmp_path: Path, hub_env: fakehub.FakeHub
) -> None:
    out, url = Path(shutil.copytree(built, tmp_path / "out")), f"hf://datasets/{REPO}"
    assert _cli("upload", out, "--to", url).exit_code == 0
    hub_env.commit(REPO, {"README.md": HANDWRITTEN})  # the dataset's owner writes their own card on the Hub
    refused = _cli("upload", out, "--to", url, "--license", "mit", "--on-conflict", "abort")
    assert refused.exit_code == 1 and hub_env.files(REPO)["README.md"] == HANDWRITTEN, refused.output
    approved = _cli("upload", out, "--to", url, "--license", "mit", "--approve-replace", _approve(refused.output))
    assert approved.exit_code == 0 and b"license: mit" in hub_env.files(REPO)["README.md"], approved.output


def test_a_folder_swapped_for_a_link_mid_write_is_not_written_through(tmp_path: Path) -> None:
    out, victim = tmp_path / "out", tmp_path / "victim"
    (out / "g").mkdir(parents=True)
    victim.mkdir()
    with atomic_file("g/x.pt", out=out) as handle:  # the door holds the folder itself, not its name
        handle.write(b"latents")
        (out / "g").rename(out / "g-moved")
        (out / "g").symlink_to(victim, target_is_directory=True)
    assert (out / "g-moved" / "x.pt").read_bytes() == b"latents" and not any(victim.iterdir())
    with pytest.raises(UnsafePath, match="symbolic link"):
        atomic_write("g/y.pt", b"latents", out=out)
    assert not any(victim.iterdir())


@st.composite
def hostile_trees(draw: st.DrawFn) -> Hostile:
    """Links out of OUT (folders swapped for links at several depths, a linked report, a linked kept spec), ledger
    paths with ``..`` or absolute, and a group a resume would encode into a link; at least one of them."""
    links = tuple(draw(st.lists(st.sampled_from(LINKED), unique=True, max_size=3)))
    rows = tuple(draw(st.lists(st.sampled_from(ROW_PATHS), max_size=2)))
    new_group = draw(st.booleans()) or not (links or rows)
    return Hostile(links, rows, draw(st.integers(0, 3)), new_group)


def _leaked(data: bytes) -> bool:
    return SECRET in data or PAYLOAD.encode() in data


@settings(
    max_examples=4,
    deadline=None,
    database=None,
    derandomize=True,  # the same three trees on every run
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(hostile=hostile_trees())
def test_hostile_out_trees_leave_the_watched_sibling_untouched(
    hostile: Hostile, built: Path, src: Path, tiny_model: Path, tmp_path: Path, bucket: str
) -> None:
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    where = scene(built, root)
    plant(where, hostile)
    before, prefix, export = where.snapshot(), f"{root.name}/", root / "export"
    commands: dict[str, Callable[[], Any]] = {
        "resume": lambda: run_build(config(src, tiny_model, where.out, workers=1, decode_samples=1)),
        "overfit": lambda: _cli("overfit", where.out, "--to", export, "--n", SAMPLES),
        "decode": lambda: _cli("decode", where.out, "--device", "cpu", "--decode-samples", SAMPLES),
        "upload": lambda: _cli("upload", where.out, "--to", f"s3://{bucket}/{prefix}", "--on-conflict", "abort"),
    }
    for name, command in commands.items():
        answer = command()
        assert "Traceback" not in str(getattr(answer, "output", "")), (name, hostile, answer.output)
        assert where.snapshot() == before, f"{name} changed the watched folder: {hostile}"
        sent = bodies(boto3.client("s3"), bucket, prefix)
        assert not any(_leaked(body) for body in sent.values()), f"{name} uploaded the watched folder: {hostile}"
        assert not any(".." in key.split("/") for key in sent), sent.keys()
        exported = [p for p in export.rglob("*") if p.is_file()] if export.exists() else []
        assert not any(_leaked(p.read_bytes()) for p in exported), f"{name} exported the watched folder: {hostile}"
