"""infra.sources: listing VBVR tar shards and reading their samples, on real clips in real tars."""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infra.demo.data import DemoSample, write_vbvr_tar
from infra.errors import InputError
from infra.preprocess.read import read
from infra.sources import Problem, SampleRef, Shard, SourceError, is_safe_name, open_source
from infra.sources.names import sample_name
from infra.sources.vbvr import ShardReadError, VbvrSource
from tests.conftest import GENERATORS, make_shards, sample

CLIP_NAMES = ("carphone", "bikes", "sample_1080p")  # the three smallest real clips (≈ 590, 510, 400 kB)
SHARD_SAMPLES = len(CLIP_NAMES)
DAMAGED_SAMPLE = 2  # the shard is cut in the middle of this sample's video
INTACT = DAMAGED_SAMPLE  # samples wholly before the cut
PROMPTS = (b"A man talks in a car.\n", b"Cyclists in traffic.\n", b"A short 1080p clip.\n")
MAX_NAME = 200  # longest safe path component
HOSTILE = b"not the sample's video"


@pytest.fixture(scope="module")
def videos(clips: dict[str, bytes]) -> tuple[bytes, ...]:
    return tuple(clips[name] for name in CLIP_NAMES)


def three_samples(videos: tuple[bytes, ...]) -> list[DemoSample]:
    """Samples 0, 1 of generator 0 and sample 2 of generator 1, with the frame PNG VBVR ships (ignored)."""
    groups = (0, 0, 1)
    return [
        sample(groups[i], i, videos[i], PROMPTS[i], **{"first_frame.png": videos[i][:64], "meta.json": b"{}"})
        for i in range(SHARD_SAMPLES)
    ]


def write_members(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A tar with exactly these member names (written verbatim, in order)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def only_shard(source: VbvrSource) -> Shard:
    (shard,) = source.shards()
    return shard


def read_all(source: VbvrSource, shard: Shard) -> list[tuple[str, str, str, bytes | None, bytes | None, dict]]:
    """(id, group, key, media, prompt, extra and problems) of each sample, read while the shard is open."""
    return [
        (ref.id, ref.group, ref.key, ref.read_media(), ref.read_prompt(), ref.extra | ref.problems)
        for ref in source.samples(shard)
    ]


def expected_rows(samples: list[DemoSample]) -> list[tuple[str, str, str, bytes | None, bytes | None, dict]]:
    return [
        (
            f"{s.task}_{s.index:08d}",
            s.generator,
            s.sample_dir,
            s.files.get("ground_truth.mp4"),
            s.files.get("prompt.txt"),
            {},
        )
        for s in samples
    ]


# ----------------------------------------------------------------------------- open_source and shards()


def test_open_source_vbvr(tmp_path: Path) -> None:
    source = open_source(f"vbvr:{tmp_path}")
    assert isinstance(source, VbvrSource)
    assert source.kind == "vbvr"


@pytest.mark.parametrize("spec", ["foo:/data", "/data/shards", "VBVR:/data"])
def test_open_source_unknown_kind(spec: str) -> None:
    with pytest.raises(SourceError, match="unknown source kind"):
        open_source(spec)


def test_missing_path_is_a_source_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no such file or directory"):
        open_source(f"vbvr:{tmp_path / 'absent'}").shards()


def test_no_tars_is_a_source_error(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "README.md").write_text("shards go here\n")
    (tmp_path / "sub" / "data.zip").write_bytes(b"PK\x05\x06" + bytes(18))
    (tmp_path / "sub" / "x.tar.part").write_bytes(b"")
    with pytest.raises(SourceError, match="no tar shards found"):
        open_source(f"vbvr:{tmp_path}").shards()
    with pytest.raises(SourceError, match="no tar shards found"):
        open_source(f"vbvr:{tmp_path}/*.tar").shards()


def test_shards_of_a_directory_recursive_and_sorted(tmp_path: Path, videos: tuple[bytes, ...]) -> None:
    samples = three_samples(videos)
    tar = write_vbvr_tar(tmp_path / "b" / "a.tar", samples[:1])
    write_vbvr_tar(tmp_path / "a" / "deep" / "z.tar", samples[1:2])
    (tmp_path / "c.tar.gz").write_bytes(gzip.compress(tar.read_bytes(), mtime=0))
    (tmp_path / "d.tgz").write_bytes(gzip.compress(tar.read_bytes(), mtime=0))
    (tmp_path / "notes.txt").write_text("not a shard\n")

    shards = open_source(f"vbvr:{tmp_path}").shards()

    assert [s.id for s in shards] == ["z", "a", "c", "d"]  # sorted by path: a/deep/z, b/a, c, d
    assert [Path(s.path) for s in shards] == [
        tmp_path / "a" / "deep" / "z.tar",
        tmp_path / "b" / "a.tar",
        tmp_path / "c.tar.gz",
        tmp_path / "d.tgz",
    ]
    assert [s.size for s in shards] == [Path(s.path).stat().st_size for s in shards]
    assert shards[1].size == tar.stat().st_size > sum(len(v) for v in videos[:1])


def test_shards_of_one_tar_and_of_a_glob(tmp_path: Path, videos: tuple[bytes, ...]) -> None:
    samples = three_samples(videos)
    make_shards(tmp_path / "x", {"shard-000": samples[:1], "shard-001": samples[1:2]})
    make_shards(tmp_path / "y", {"shard-002": samples[2:]})

    (one,) = open_source(f"vbvr:{tmp_path / 'x' / 'shard-001.tar'}").shards()
    assert (one.id, Path(one.path)) == ("shard-001", tmp_path / "x" / "shard-001.tar")

    found = open_source(f"vbvr:{tmp_path}/**/shard-00[02].tar").shards()
    assert [s.id for s in found] == ["shard-000", "shard-002"]


@pytest.mark.parametrize(
    "names",
    [("a/x.tar", "b/x.tar"), ("x.tar", "x.tar.gz"), ("x.tgz", "sub/x.tar")],
)
def test_duplicate_shard_ids_are_a_source_error(tmp_path: Path, videos: tuple[bytes, ...], names: tuple) -> None:
    for name in names:  # (listing looks at names only: plain tar bytes under a .tgz name are fine here)
        write_vbvr_tar(tmp_path / "src" / name, three_samples(videos)[:1])
    with pytest.raises(SourceError, match="two shards share the id 'x'"):
        open_source(f"vbvr:{tmp_path / 'src'}").shards()


@pytest.mark.parametrize("name", ["my shard.tar", "..tar.gz", "-x.tar", "shard;rm.tar"])
def test_unsafe_shard_file_name_is_a_source_error(tmp_path: Path, name: str) -> None:
    write_members(tmp_path / name, [("G-1/t_task/t_00000001/prompt.txt", b"p")])
    with pytest.raises(SourceError, match="cannot be used as a shard id"):
        open_source(f"vbvr:{tmp_path}").shards()


# ----------------------------------------------------------------------------- samples(): the layout


@pytest.mark.parametrize("dir_entries", [True, False])
def test_samples_of_a_shard(tmp_path: Path, videos: tuple[bytes, ...], dir_entries: bool) -> None:
    samples = three_samples(videos)
    write_vbvr_tar(tmp_path / "shard-000.tar", samples, dir_entries=dir_entries)
    source = open_source(f"vbvr:{tmp_path}")
    rows = read_all(source, only_shard(source))

    assert rows == expected_rows(samples)
    assert [r[1] for r in rows] == [GENERATORS[0], GENERATORS[0], GENERATORS[1]]
    assert rows[0][0] == "handle_object_reappearance_00000000"
    assert rows[2][0] == "ball_trajectory_00000002"


def test_missing_members_read_as_none(tmp_path: Path, videos: tuple[bytes, ...]) -> None:
    samples = [
        sample(0, 1, videos[0], None),
        sample(0, 2, None, PROMPTS[1], **{"first_frame.png": videos[1][:64]}),
        sample(1, 3, videos[2], PROMPTS[2]),
    ]
    source = open_source(f"vbvr:{make_shards(tmp_path, {'s': samples})}")
    rows = read_all(source, only_shard(source))

    assert rows == expected_rows(samples)
    assert (rows[0][3], rows[0][4]) == (videos[0], None)
    assert (rows[1][3], rows[1][4]) == (None, PROMPTS[1])


def test_symlink_member_is_not_followed(tmp_path: Path, videos: tuple[bytes, ...]) -> None:
    tar = tmp_path / "links.tar"
    with tarfile.open(tar, "w") as tf:
        link = tarfile.TarInfo("G-1/t_task/t_00000001/ground_truth.mp4")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(link)
        prompt = tarfile.TarInfo("G-1/t_task/t_00000001/prompt.txt")
        prompt.size = len(PROMPTS[0])
        tf.addfile(prompt, io.BytesIO(PROMPTS[0]))
    source = open_source(f"vbvr:{tar}")
    rows = read_all(source, only_shard(source))
    assert rows == [("t_00000001", "G-1", "G-1/t_task/t_00000001", None, PROMPTS[0], {})]


LAYOUT_ERRORS = {
    # directory of the member → id reported
    "G-1/foo/bar": "G-1/foo/bar",
    "G-1/t_task/t_123": "G-1/t_task/t_123",
    "G-1/t_task/t_000000001": "G-1/t_task/t_000000001",  # 9 digits
    "G-1/t_task/u_00000001": "G-1/t_task/u_00000001",  # task and id disagree
    "t_task/t_00000001": "t_task/t_00000001",  # no generator directory
    "": "",  # a bare ground_truth.mp4 at the top
}


def test_directories_outside_the_layout_are_flagged_not_dropped(tmp_path: Path) -> None:
    members = [("G-1/t_task/t_00000001/prompt.txt", b"good")]
    members += [(f"{d}/ground_truth.mp4".lstrip("/"), d.encode()) for d in LAYOUT_ERRORS]
    source = open_source(f"vbvr:{write_members(tmp_path / 's.tar', members)}")
    refs = {
        ref.id: (ref.group, ref.read_media(), ref.extra | ref.problems) for ref in source.samples(only_shard(source))
    }

    assert refs.pop("t_00000001") == ("G-1", None, {})
    assert sorted(refs) == sorted(LAYOUT_ERRORS.values())
    for directory, sid in LAYOUT_ERRORS.items():
        group, media, extra = refs[sid]
        assert group == ""
        assert media == directory.encode()
        assert extra[Problem.BAD_LAYOUT].startswith("not {generator}/{task}_task/{task}_NNNNNNNN/")


@pytest.mark.parametrize(
    "directory",
    [
        "../t_task/t_00000001",  # generator ".."
        "top/../t_task/t_00000001",  # generator ".." below a wrapper folder
        "G 1/t_task/t_00000001",  # generator with a space
        "G-1/my task_task/my task_00000001",  # id with a space
        "G-1/t;x_task/t;x_00000001",  # id with a shell metacharacter
    ],
)
def test_unsafe_names_are_flagged(tmp_path: Path, directory: str) -> None:
    tar = write_members(tmp_path / "s.tar", [(f"{directory}/prompt.txt", b"p")])
    source = open_source(f"vbvr:{tar}")
    ((_, _, _, media, prompt, extra),) = read_all(source, only_shard(source))
    assert (media, prompt) == (None, b"p")
    assert extra[Problem.BAD_LAYOUT]


def test_a_wrapper_folder_above_the_generator_is_accepted(tmp_path: Path) -> None:
    """``wrap/{generator}/...``: the layout is matched at the end of the path."""
    tar = write_members(tmp_path / "s.tar", [("wrap/G-1/t_task/t_00000001/prompt.txt", b"p")])
    source = open_source(f"vbvr:{tar}")
    rows = read_all(source, only_shard(source))
    assert rows == [("t_00000001", "G-1", "wrap/G-1/t_task/t_00000001", None, b"p", {})]


@pytest.mark.parametrize("prefix", ["../", "/", "."])
def test_traversal_prefixes_are_not_merged_into_a_real_sample(tmp_path: Path, prefix: str) -> None:
    members = [
        ("G-1/t_task/t_00000001/prompt.txt", b"the real prompt"),
        (f"{prefix}G-1/t_task/t_00000001/ground_truth.mp4", HOSTILE),
    ]
    source = open_source(f"vbvr:{write_members(tmp_path / 's.tar', members)}")
    rows = read_all(source, only_shard(source))
    clean = [row for row in rows if Problem.BAD_LAYOUT not in row[5]]
    assert all(row[3] != HOSTILE for row in clean)  # no clean sample reads the hostile member
    assert any(row[3] == HOSTILE for row in rows)  # and it is reported, not dropped


def test_generator_with_a_trailing_newline_is_flagged(tmp_path: Path) -> None:
    tar = write_members(tmp_path / "s.tar", [("G-1\n/t_task/t_00000001/prompt.txt", b"p")])
    source = open_source(f"vbvr:{tar}")
    (ref,) = list(source.samples(only_shard(source)))
    assert ref.group == "G-1\n"
    assert ref.problems.get(Problem.BAD_LAYOUT)


def test_sample_folder_without_either_member_is_listed(tmp_path: Path, videos: tuple[bytes, ...]) -> None:
    samples = [sample(0, 1, videos[0], PROMPTS[0]), sample(0, 2, None, None, **{"first_frame.png": videos[1][:64]})]
    source = open_source(f"vbvr:{make_shards(tmp_path, {'s': samples})}")
    rows = read_all(source, only_shard(source))
    assert rows == expected_rows(samples)


# ----------------------------------------------------------------------------- compressed, damaged, lazy


@pytest.mark.parametrize("suffix", [".tar.gz", ".tgz"])
def test_gzip_shard_reads_like_a_plain_tar(tmp_path: Path, videos: tuple[bytes, ...], suffix: str) -> None:
    samples = three_samples(videos)
    tar = write_vbvr_tar(tmp_path / "plain" / "shard-7.tar", samples)
    packed = tmp_path / "packed" / f"shard-7{suffix}"
    packed.parent.mkdir()
    packed.write_bytes(gzip.compress(tar.read_bytes(), mtime=0))
    assert packed.read_bytes()[:2] == b"\x1f\x8b"

    plain_source, packed_source = open_source(f"vbvr:{tar.parent}"), open_source(f"vbvr:{packed.parent}")
    plain_shard, packed_shard = only_shard(plain_source), only_shard(packed_source)
    assert plain_shard.id == packed_shard.id == "shard-7"
    assert read_all(packed_source, packed_shard) == read_all(plain_source, plain_shard) == expected_rows(samples)


def damaged_shard(tmp_path: Path, videos: tuple[bytes, ...], compressed: bool) -> tuple[Path, list[DemoSample]]:
    """The three-sample shard cut in the middle of sample 2's video (plain, or its gzip cut at the same point)."""
    samples = three_samples(videos)
    tar = write_vbvr_tar(tmp_path / "whole" / "s.tar", samples)
    with tarfile.open(tar) as tf:
        video = tf.getmember(f"{samples[DAMAGED_SAMPLE].sample_dir}/ground_truth.mp4")
    data = tar.read_bytes()
    cut = video.offset_data + video.size // 2
    out = tmp_path / "damaged" / ("s.tar.gz" if compressed else "s.tar")
    out.parent.mkdir()
    if compressed:  # the clips are already compressed, so the gzip stream is close to 1:1 with the tar
        packed = gzip.compress(data, mtime=0)
        out.write_bytes(packed[: len(packed) * cut // len(data)])
    else:
        out.write_bytes(data[:cut])
    return out, samples


@pytest.mark.parametrize("compressed", [False, True], ids=["tar", "tar.gz"])
def test_damaged_shard_yields_the_samples_before_then_raises(
    tmp_path: Path, videos: tuple[bytes, ...], compressed: bool
) -> None:
    path, samples = damaged_shard(tmp_path, videos, compressed)
    source = open_source(f"vbvr:{path}")
    seen: list[str] = []
    intact = expected_rows(samples[:INTACT])
    with pytest.raises(ShardReadError, match="tar damaged"):
        for ref in source.samples(only_shard(source)):
            seen.append(ref.id)
            if len(seen) <= INTACT:
                row = (ref.id, ref.group, ref.key, ref.read_media(), ref.read_prompt(), ref.extra | ref.problems)
                assert row == intact[len(seen) - 1]
    assert seen[:INTACT] == [row[0] for row in intact]
    assert len(seen) <= SHARD_SAMPLES


def test_damaged_member_reads_as_an_input_problem(tmp_path: Path, videos: tuple[bytes, ...]) -> None:
    path, samples = damaged_shard(tmp_path, videos, compressed=False)
    source = open_source(f"vbvr:{path}")
    damaged_id = f"{samples[DAMAGED_SAMPLE].task}_{DAMAGED_SAMPLE:08d}"
    outcomes: dict[str, object] = {}

    def read(ref: SampleRef) -> object:
        try:
            return ref.read_media()
        except (InputError, ShardReadError) as exc:
            return type(exc)

    with pytest.raises(ShardReadError):
        for ref in source.samples(only_shard(source)):
            outcomes[ref.id] = read(ref)
    # the cut sample is either not listed, or reading it says why (never half a video, never a raw tar error)
    assert outcomes.get(damaged_id, ShardReadError) in (ShardReadError, InputError, None)


def test_reading_is_lazy_and_extracts_nothing(
    tmp_path: Path, videos: tuple[bytes, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = three_samples(videos)
    shard_dir = tmp_path / "shards"
    tar = write_vbvr_tar(shard_dir / "s.tar", samples)
    monkeypatch.chdir(shard_dir)
    source = open_source(f"vbvr:{shard_dir}")
    refs: list[SampleRef] = []
    read: dict[str, tuple[bytes | None, bytes | None]] = {}
    for ref in source.samples(only_shard(source)):
        refs.append(ref)
        if len(refs) == SHARD_SAMPLES:  # random access: read every sample, last first, while the tar is open
            for earlier in reversed(refs):
                read[earlier.id] = (earlier.read_media(), earlier.read_prompt())
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == [Path("shards"), Path("shards/s.tar")]
    assert tar.stat().st_size > sum(len(v) for v in videos)
    assert [read[row[0]] for row in expected_rows(samples)] == [(s[3], s[4]) for s in expected_rows(samples)]


# ----------------------------------------------------------------------------- is_safe_name


@pytest.mark.parametrize(
    "name",
    [
        GENERATORS[0],
        "handle_object_reappearance_00000001",
        "shard-000",
        "a",
        "0",
        "A.b+c=d-e_f",
        "x" * MAX_NAME,
    ],
)
def test_safe_names(name: str) -> None:
    assert is_safe_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".",
        "..",
        "a..b",
        ".hidden",
        "-x",
        "_x",
        "a/b",
        "a\\b",
        "a b",
        "a:b",
        "a\x00b",
        "café",
        "x" * (MAX_NAME + 1),
    ],
)
def test_unsafe_names(name: str) -> None:
    assert not is_safe_name(name)


@pytest.mark.parametrize("name", ["G-1\n", "x" * MAX_NAME + "\n"])
def test_trailing_newline_is_unsafe(name: str) -> None:
    assert not is_safe_name(name)


@settings(max_examples=40, deadline=None)
@given(
    found=st.dictionaries(st.sampled_from(list(Problem)), st.text(max_size=20), max_size=len(Problem)),
    group=st.sampled_from(["G-1", "", "root"]),
)
def test_a_sample_is_refused_for_its_first_problem_before_a_byte_is_read(found: dict, group: str) -> None:
    def unread() -> bytes:
        raise AssertionError("a sample with a problem was read")

    ref = SampleRef(id="t_00000001", group=group, key="k", read_media=unread, read_prompt=unread, problems=found)
    if not found:
        assert ref.problem is None
        return
    first = next(kind for kind in Problem if kind in found)  # the order read() checked the extra's strings in
    with pytest.raises(InputError) as refused:
        read(ref)
    assert refused.value.reason == first.value == ref.problem.kind.value
    if first is Problem.DUPLICATE_ID:
        met = sample_name(group, "t_00000001")
        assert refused.value.detail == f"{met} is also {found[first]}, met first: that one is encoded"
    else:
        assert refused.value.detail == found[first]
    assert [k.value for k in Problem] == [
        "bad_row",
        "bad_layout",
        "outside_source",
        "duplicate_id",
        "name_collision",
        "superseded",
    ]
