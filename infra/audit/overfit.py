"""The overfit / validation export: a tiny cache of a few samples, each replicated under distinct ids.

Before a long run, a trainer proves its loop can memorise one sample. `export_overfit` writes, into a new
directory (never into OUT), a cache in OUT's own format and spec: the chosen samples' files copied C times as
``<id>-c000``, ``<id>-c001``, ... (so every data-parallel rank gets a batch), with its own cache.json and ledger
(it passes verify-existing as a cache of its own); ``reference/<stem>.mp4`` (the sample's output stem, unique in
the cache: ``<group>/<id>`` for VBVR, ``G-11/clip0/video`` for a folder's ``G-11/clip0/video.mp4``), the exact
pixels each sample's latents were made from (lossless RGB H.264 of the recipe's pixels, quantised to 8 bits), for SSIM
checks; and ``validation_prompts.json`` (``{"data": [{"caption": ...}]}``) with their prompts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from infra import outdir
from infra.audit.decode_verify import choose_samples
from infra.audit.stems import sample_stem
from infra.cache import ledger
from infra.cache.cachedir import read_cache_json, write_cache_json
from infra.cache.ledger import FileRecord, LedgerRow, window_of
from infra.config import CacheSpec
from infra.errors import ConfigError
from infra.formats import get_format
from infra.media.mp4 import mp4_bytes
from infra.media.prompts import CaptionRules, caption_prompt
from infra.models import get_family
from infra.outdir import OutFile
from infra.outstore import is_url
from infra.preprocess.prepare import prepare_video
from infra.sources import SampleRef, open_source
from infra.sources.names import sample_name
from infra.storage import atomic_write, staged_dir

logger = logging.getLogger(__name__)

SHARD = "overfit"
PROMPTS = "validation_prompts.json"


@dataclass
class OverfitResult:
    to: str
    samples: list[str] = field(default_factory=list)  # GROUP/ID of the chosen samples
    rows: int = 0  # samples in the export (samples × copies)
    references: list[str] = field(default_factory=list)  # the reference mp4s, relative to `to`


def export_overfit(
    out: Path,
    to: Path,
    *,
    ids: list[str] | None = None,
    n: int | None = None,
    copies: int = 1,
    source: str | None = None,
) -> OverfitResult:
    """Export the samples named by `ids` (ID or GROUP/ID), or `n` spread over groups, `copies` times each, to
    `to` (absent or empty; built aside and renamed into place). `source` overrides the source OUT was built from
    (where the reference clips and prompts are read). ConfigError for bad choices; nothing is written then."""
    if is_url(str(out)) or not isinstance(out, (str, Path)):
        raise ConfigError(f"overfit: export from a local OUT ({out} is in an object store: copy it down first)")
    out, to = Path(out).resolve(), Path(to).resolve()
    if to == out or to.is_relative_to(out) or out.is_relative_to(to):
        raise ConfigError(f"the overfit export never writes into OUT: {to} and {out} overlap")
    if copies < 1 or (ids is None) == (n is None) or (n is not None and n < 1):
        raise ConfigError("overfit: give --ids ID... or --n K (K ≥ 1), and --copies C ≥ 1")
    meta = read_cache_json(out)
    spec = CacheSpec.model_validate(meta["spec"])
    if get_format(spec.format, spec.family).sharded:
        raise ConfigError(
            f"overfit: the {spec.format} format keeps samples inside shard files; export from a pt or ltx build of "
            "the same samples (the overfit export copies per-sample files)"
        )
    if "latents" not in get_family(spec.family).kinds(spec):
        raise ConfigError(
            f"overfit: a --mode {spec.mode} cache holds no video latents, and the export's references are the "
            "pixels video latents were made from"
        )
    rows = _choose(out, ids, n)
    spec_source = source or meta.get("provenance", {}).get("source")
    if not spec_source:
        raise ConfigError(f"{out}/cache.json does not say which source it was built from: give --source")
    refs = _source_refs(spec_source, rows, spec)
    result = OverfitResult(str(to), samples=[sample_name(r.group, r.id) for r in rows])
    with staged_dir(to, "the overfit export") as staging:
        new_rows, prompts = [], []
        for row in rows:
            ref = refs[(row.shard, window_of(row)[0])]
            media = ref.read_media()
            if media is None:
                raise ConfigError(f"{sample_name(row.group, row.id)}: its source sample has no video now")
            prompts.append({"caption": caption_prompt(ref.read_prompt(), CaptionRules.of(spec))})
            prepared = prepare_video(media, spec, window_of(row)[1])
            rel = f"reference/{sample_stem(row, get_format(spec.format, spec.family))}.mp4"
            fps = float(row.extra.get("sampling", {}).get("fps") or prepared.clip.fps)
            atomic_write(rel, lossless_mp4(prepared.pixels[0], fps), out=staging)  # the door: inside the export
            result.references.append(rel)
            new_rows += [_copy(out, staging, spec.format, row, c) for c in range(copies)]
        write_cache_json(staging, spec, {**meta.get("provenance", {}), "overfit_of": str(out), "copies": copies})
        ledger.seal(staging, SHARD, new_rows)
        body = json.dumps({"data": prompts}, indent=2, ensure_ascii=False) + "\n"
        atomic_write(PROMPTS, body.encode(), out=staging)
        result.rows = len(new_rows)
    logger.info("overfit export %s: %d sample(s) × %d copies", to, len(rows), copies)
    return result


def _choose(out: Path, ids: list[str] | None, n: int | None) -> list[LedgerRow]:
    done = [r for rows in ledger.read_all(out).values() for r in rows.values() if r.status == "done"]
    if n is not None:
        chosen = choose_samples(done, n)
        if not chosen:
            raise ConfigError(f"{out} has no done sample to export")
        return chosen
    by_name = {sample_name(r.group, r.id): r for r in done}
    by_id: dict[str, list[LedgerRow]] = {}
    for r in done:
        by_id.setdefault(r.id, []).append(r)
    chosen, unknown = [], []
    for name in ids or []:
        if name in by_name:
            chosen.append(by_name[name])
        elif len(by_id.get(name, [])) == 1:
            chosen.append(by_id[name][0])
        elif name in by_id:
            raise ConfigError(f"--ids {name}: in several groups ({len(by_id[name])}); give GROUP/ID")
        else:
            unknown.append(name)
    if unknown:
        raise ConfigError(f"--ids: no done sample {', '.join(unknown)} in {out}")
    return chosen


def _source_refs(source: str, rows: list[LedgerRow], spec: CacheSpec) -> dict[tuple[str, str], SampleRef]:
    """The source refs of the rows' clips, by (shard, key), each shard walked once (bytes read lazily)."""
    wanted = {(r.shard, window_of(r)[0]) for r in rows}
    src = open_source(source, spec)
    found: dict[tuple[str, str], SampleRef] = {}
    for shard in src.shards():
        keys = {k for s, k in wanted if s == shard.id}
        if not keys:
            continue
        with contextlib.closing(src.samples(shard)) as samples:
            for ref in samples:
                if ref.key in keys:
                    media, prompt = ref.read_media(), ref.read_prompt()  # read while the shard is open
                    found[(shard.id, ref.key)] = _held(ref, media, prompt)
    if missing := sorted(f"{s}/{k}" for s, k in wanted - found.keys()):
        raise ConfigError(f"not found in the source {source}: {', '.join(missing)}")
    return found


def _held(ref: SampleRef, media: bytes | None, prompt: bytes | None) -> SampleRef:
    """`ref` with its bytes already read (a shard's members are readable only while it is being iterated)."""
    return dataclasses.replace(ref, read_media=lambda: media, read_prompt=lambda: prompt, read_together=None)


def _copy(out: Path, staging: Path, fmt_name: str, row: LedgerRow, copy: int) -> LedgerRow:
    """Copy `copy` of a sample: each file as ``<name>-cNNN<suffix>`` beside where it was, its stored id renamed
    (a format that stores none is copied byte for byte); the row says what it is a copy of."""
    fmt = get_format(fmt_name)
    suffix = f"-c{copy:03d}"
    new_id = row.id + suffix
    records = []
    for file in row.output_files():
        # read from OUT and written into the export through the door: a ledger path outside OUT, or through a link,
        # is refused (UnsafePath) before a byte is read or written
        folder, name = outdir.split(file.path)
        stem, dot, ext = name.rpartition(".")
        rel = outdir.join(folder, f"{stem}{suffix}{dot}{ext}" if dot else f"{name}{suffix}")
        record = fmt.read(OutFile(out, file.path))  # weights_only
        if isinstance(record, dict) and "id" in record:
            buffer = io.BytesIO()
            torch.save({**record, "id": new_id}, buffer)
            data = buffer.getvalue()
        else:
            data = outdir.read_bytes(out, file.path)
        written = atomic_write(rel, data, out=staging)
        records.append(FileRecord(path=rel, bytes=written.bytes, sha256=written.sha256, kinds=file.kinds))  # kinds kept
    return row.model_copy(
        update={
            "key": row.key + suffix,
            "id": new_id,
            "shard": SHARD,
            "path": records[0].path,
            "sha256": records[0].sha256,
            "bytes": sum(r.bytes for r in records),
            "files": records if len(records) > 1 else [],
            "source": None,
            "extra": {**{k: v for k, v in row.extra.items() if k != "run_id"}, "overfit_of": f"{row.shard}/{row.key}"},
        }
    )


def lossless_mp4(pixels: torch.Tensor, fps: float) -> bytes:
    """(3, F, H, W) pixels in [-1, 1] as lossless RGB H.264 (libx264rgb, crf 0) of their 8-bit rounding."""
    frames = ((pixels.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).contiguous().numpy()
    return mp4_bytes(frames, fps, "libx264rgb", "rgb24", {"crf": "0"})
