"""Bounded reads through real builds: a 10 GB sparse file in a `folder:` source, a tar whose GNU-sparse member claims
10 GB, and PNGs declaring 50000×50000 pixels are skipped rows (``too_large``, ``too_many_pixels``) before their
bytes are held; the sanity passes over them, a shard that starts with three of them is not taken for a broken
model, every other sample is encoded, the run ends as its loss policy says, and the process's peak memory stays
small. The sparse file costs no disk (a hole); the tar is a few KiB."""

from __future__ import annotations

import os
import resource
import struct
import tarfile
import tracemalloc
import zlib
from pathlib import Path

import pytest

from flows.terminal_run import run_build
from infra.cache import ledger
from infra.demo.tiny_image import make_tiny_image
from infra.sources import open_source
from tests.conftest import config
from tests.image_media import StillImage, sample_images, write_folder

HEIGHT, WIDTH = 32, 48
BOMB_BYTES = 10 << 30  # what the sparse file and the sparse member claim
BOMB_SIDE = 50_000  # 2.5e9 pixels: past --max-pixels and past Pillow's own refusal at open
#: Peak RSS growth allowed over the builds (they need ~100 MiB here; reading a bomb whole would need 10 GiB).
MEMORY_BOUND_MB = 1024
MTIME = 1_700_000_000
BLOCK = 512


def _octal(value: int, width: int = 12) -> bytes:
    """A tar number field: octal, or GNU base-256 when it does not fit (10 GB does not in 11 octal digits)."""
    if value < 8 ** (width - 1):
        return b"%0*o\0" % (width - 1, value)
    return b"\x80" + value.to_bytes(width - 1, "big")


def sparse_member(name: str, claimed: int, stored: bytes) -> bytes:
    """An old-GNU sparse member (type ``S``): `stored` is its one data run at offset 0, the rest up to `claimed`
    bytes a hole, as GNU tar writes a file with holes. tarfile writes no sparse member, so the header is made here:
    its sparse map at byte 386, the size it expands to at byte 483, then the checksum again."""
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mtime = tarfile.GNUTYPE_SPARSE, len(stored), MTIME
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    header[386:410] = _octal(0) + _octal(len(stored))
    header[483:495] = _octal(claimed)
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header) + stored + b"\0" * (-len(stored) % BLOCK)


def _plain_member(name: str, data: bytes) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), MTIME
    return info.tobuf(format=tarfile.GNU_FORMAT) + data + b"\0" * (-len(data) % BLOCK)


def write_tar(path: Path, members: list[bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(members) + b"\0" * (2 * BLOCK))
    return path


def png_declaring(side: int) -> bytes:
    """A valid PNG of under 100 bytes whose header declares side×side RGB pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 4096))
        + chunk(b"IEND", b"")
    )


def _image_sample(key: str, image: bytes, caption: str) -> list[bytes]:
    return [_plain_member(f"{key}.png", image), _plain_member(f"{key}.txt", caption.encode())]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_image(tmp_path_factory.mktemp("bounds") / "dc-none", vae="dc", text="none")


@pytest.fixture(scope="module")
def images() -> list[StillImage]:
    return [image for image in sample_images() if image.data.startswith(b"\x89PNG")][:3]


def _build(source: str, model: Path, out: Path, **overrides: object) -> tuple[bool, object, float]:
    """(ok, result, peak RSS growth in MiB) of a build of the image family at a tiny geometry."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    values = {"source": source, "family": None, "height": HEIGHT, "width": WIDTH, "frames": 1, **overrides}
    ok, result = run_build(config(Path("-"), model, out, decode_samples=0, **values))
    return ok, result, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def test_a_sparse_10gb_file_in_a_folder_is_too_large_before_it_is_read_and_the_loss_gate_decides(
    tmp_path, model, images
):
    src = write_folder(tmp_path / "photos", images)
    bomb = src / "bomb.mp4"
    bomb.touch()
    os.truncate(bomb, BOMB_BYTES)  # a hole: no disk used
    (src / "bomb.txt").write_text("ten gigabytes of nothing")
    ok, result, grown = _build(f"folder:{src}", model, tmp_path / "out", on_loss="abort")
    rows = ledger.read_shard(tmp_path / "out", "photos-00000")
    assert rows["bomb.mp4"].status == "skipped" and rows["bomb.mp4"].reason == "too_large"
    assert "10737418240 bytes" in rows["bomb.mp4"].detail and "--max-media-mb 2048" in rows["bomb.mp4"].detail
    assert sorted(k for k, r in rows.items() if r.status == "done") == sorted(
        f"{i.mode.lower()}/set-1/{i.key}.png" for i in images
    )
    assert not ok and "missing" in str(result)  # --on-loss abort: the skipped bomb is a loss, and the run says so
    assert grown < MEMORY_BOUND_MB, f"peak RSS grew {grown:.0f} MiB"
    ok, result, _ = _build(f"folder:{src}", model, tmp_path / "out", on_loss="accept", max_media_mb=1)
    assert ok, result  # the resume completes; the row stays the one reason (a cap of 1 MiB reads the images still)
    assert ledger.read_shard(tmp_path / "out", "photos-00000").keys() == rows.keys()


def test_a_sparse_tar_member_and_pillow_bombs_are_skipped_and_every_good_image_is_encoded(tmp_path, model, images):
    bomb = png_declaring(BOMB_SIDE)
    first = [*_image_sample("a0-bomb", bomb, "declares 2.5e9 pixels")]  # first in the plan: the sanity's first pick
    first += [sparse_member("a1-sparse.png", BOMB_BYTES, bomb), _plain_member("a1-sparse.txt", b"ten gigabytes")]
    first += _image_sample("a2-good", images[0].data, images[0].caption)
    second = [m for i in range(3) for m in _image_sample(f"b{i}-bomb", bomb, "a bomb")]  # three at the shard's start
    second += [m for i, image in enumerate(images[1:], 3) for m in _image_sample(f"b{i}-good", image.data, "good")]
    src = tmp_path / "src"
    write_tar(src / "a.tar", first)
    write_tar(src / "b.tar", second)
    with tarfile.open(src / "a.tar") as tf:
        assert tf.getmember("a1-sparse.png").issparse() and tf.getmember("a1-sparse.png").size == BOMB_BYTES
    ok, result, grown = _build(f"wds:{src}", model, tmp_path / "out", on_loss="accept")
    assert ok, result
    rows = {shard: ledger.read_shard(tmp_path / "out", shard) for shard in ("a", "b")}
    reasons = {key: (row.status, row.reason) for shard in rows.values() for key, row in shard.items()}
    assert reasons == {
        "a0-bomb": ("skipped", "too_many_pixels"),
        "a1-sparse": ("skipped", "too_large"),
        "a2-good": ("done", None),
        **{f"b{i}-bomb": ("skipped", "too_many_pixels") for i in range(3)},
        **{f"b{i}-good": ("done", None) for i in range(3, 3 + len(images) - 1)},
    }
    assert "a sparse tar member that expands to 10737418240 bytes" in rows["a"]["a1-sparse"].detail
    assert "--max-media-mb" in rows["a"]["a1-sparse"].detail
    assert grown < MEMORY_BOUND_MB, f"peak RSS grew {grown:.0f} MiB"


def test_a_sparse_member_under_the_cap_reads_as_tarfile_expands_it(tmp_path):
    """A small sparse member is read (its holes as zeros, as tarfile gives them), not refused for being sparse."""
    stored = b"\x89PNG\r\n\x1a\n" + b"x" * 100
    write_tar(tmp_path / "src" / "s.tar", [sparse_member("k.png", 4096, stored), _plain_member("k.txt", b"cap")])
    source = open_source(f"wds:{tmp_path / 'src'}")
    read = [ref.read_media() for ref in source.samples(source.shards()[0])]  # readable while its shard is open
    with tarfile.open(tmp_path / "src" / "s.tar") as tf:
        expected = tf.extractfile("k.png").read()
    assert read == [expected] and expected == stored + b"\0" * (4096 - len(stored))


#: Members of the listing check and the bound on peak traced memory per sample listed: ~530 B a VBVR sample of two
#: members now, ~1.8 KB before (tarfile's headers, kept twice over). Small: tracemalloc slows tarfile's parsing ~5×.
LISTED_MEMBERS, BYTES_PER_SAMPLE = 4_000, 900


def test_listing_a_big_tar_keeps_little_per_sample(tmp_path):
    """A tar's listing (what the plan and every shard task hold while they walk a shard) keeps small records, not
    tarfile's headers: peak traced memory per sample listed stays under a bound (`bench/tar_memory_bench.py` has
    the figures at 10^5 and 10^6 members)."""
    generator, task = "G-11_handle_object_reappearance_data-generator", "handle_object_reappearance"
    members = []
    for index in range(LISTED_MEMBERS // 2):
        directory = f"{generator}/{task}_task/{task}_{index:08d}"
        members += [_plain_member(f"{directory}/ground_truth.mp4", b""), _plain_member(f"{directory}/prompt.txt", b"p")]
    write_tar(tmp_path / "src" / "big.tar", members)
    source = open_source(f"vbvr:{tmp_path / 'src'}")
    tracemalloc.start()
    try:
        listed = sum(1 for _ in source.samples(source.shards()[0]))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert listed == LISTED_MEMBERS // 2
    assert peak / listed < BYTES_PER_SAMPLE, f"{peak / listed:.0f} B a sample listed"
