"""`latentforge inspect OUT`: what a cache holds, from cache.json, the ledgers and one sample per group."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from infra import outdir
from infra.cache import ledger
from infra.cache.cachedir import PENDING_JSON, overwrite_in_progress, read_cache_json
from infra.cache.ledger import FileRecord, LedgerRow
from infra.config import CacheSpec
from infra.errors import DamagedCacheError
from infra.formats import get_format
from infra.formats.base import Format
from infra.formats.consumers import written_for
from infra.formats.shards import ShardFormat, shard_summary
from infra.gates.unowned import Scan
from infra.media.buckets import Bucket
from infra.outdir import UnsafePath
from infra.plan import spec_settings
from infra.preprocess.build_summary import geometry_lines
from infra.sources.names import group_name


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, str) and len(value) > 72:
        return value[:69] + "..."
    return value


def _read(fmt: Format, out: Path, file: FileRecord) -> dict[str, Any]:
    """One stored file (or a shard file's member) through the format's safe reader (weights_only);
    DamagedCacheError when it does not load."""
    path = out / file.path
    try:
        record = fmt.read_file(out, file)  # through the door: a path outside OUT or through a link is refused
    except UnsafePath:
        raise
    except Exception as exc:  # whatever stops a safe load (a pickle with code, a torn file) is damage
        text = str(exc)
        reason = " ".join(text[max(text.find("WeightsUnpickler error:"), 0) :].split())[:160]
        raise DamagedCacheError(
            f"{path}: does not load with weights_only=True ({type(exc).__name__}: {reason}); `latentforge verify` "
            "lists every damaged file"
        ) from exc
    if not isinstance(record, dict):
        raise DamagedCacheError(f"{path}: holds a {type(record).__name__}, not a dict of tensors")
    return record


def _policy_names(spec: dict[str, Any]) -> dict[str, Any]:
    """The temporal and resize policies by the names their flags take (``span``, ``stretch``), not the spec's
    stored values (``linspace``, ``bilinear-align_corners_false``); the stored values where the spec does not parse."""
    try:
        settings = spec_settings(CacheSpec.model_validate(spec))
    except (ValueError, TypeError):  # an older or hand-edited spec: show what it stores
        return {"temporal": spec.get("temporal"), "resize": spec.get("resize")}
    return {"temporal": settings["temporal"], "resize": settings["resize"]}


def _tensors(fmt: Format, out: Path, row: LedgerRow) -> dict[str, Any]:
    """Every output key of one done sample, over all of its files (LTX-2: latents, conditions, audio), described."""
    found: dict[str, Any] = {}
    for file in row.output_files():
        found.update({k: _describe(v) for k, v in _read(fmt, out, file).items()})
    return found


def cache_geometries(out: Path, spec: dict[str, Any], rows: Iterable[LedgerRow]) -> list[dict[str, Any]]:
    """Each geometry the done samples were encoded at, most samples first: frames, height, width (the bucket a row
    records; the spec's own without buckets), how many samples, and every output key of one of them as the format
    wrote it (shape and dtype for a tensor)."""
    fmt = get_format(spec["format"], spec.get("family"))
    found: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in rows:
        if row.status != "done" or not row.output_files():
            continue
        frames, height, width = row.extra.get("geometry") or (spec["frames"], spec["height"], spec["width"])
        entry = found.setdefault(
            (frames, height, width, tuple(row.latent_shape or ())),
            {"frames": frames, "height": height, "width": width, "samples": 0, "example": row},
        )
        entry["samples"] += 1
    shown = sorted(found.values(), key=lambda e: (-e["samples"], -e["frames"], -e["height"], -e["width"]))
    for entry in shown:
        example: LedgerRow = entry.pop("example")
        entry["outputs"] = _tensors(fmt, out, example)
    return shown


def repeated_frames(rows: Iterable[LedgerRow]) -> int:
    """Done samples whose picked frames repeat (a clip shorter than its geometry's frames: a 1-frame clip at 17)."""
    count = 0
    for row in rows:
        indices = (row.extra.get("sampling") or {}).get("indices") or []
        count += row.status == "done" and len(set(indices)) < len(indices)
    return count


def rotated_clips(rows: Iterable[LedgerRow]) -> dict[str, int]:
    """Done samples made of a clip with a display matrix: ``group/id`` → its rotation (degrees counter-clockwise)."""
    found = {}
    for row in rows:
        rotation = (row.extra.get("sampling") or {}).get("rotation")
        if row.status == "done" and rotation:
            found[f"{row.group}/{row.id}"] = int(rotation)
    return dict(sorted(found.items()))


def inspect_cache(out: Path) -> dict[str, Any]:
    """Counts per group and status, bytes, fingerprint, and the keys/shapes/dtypes of one sample per group."""
    out = outdir.root(out)
    meta = read_cache_json(out)  # in a store, an unfinished run's pending one where there is one
    unfinished = outdir.is_store(out) and outdir.lstat(out, PENDING_JSON) is not None
    fmt = get_format(meta["spec"]["format"], meta["spec"].get("family"))
    groups: dict[str, Counter[str]] = defaultdict(Counter)
    reasons: Counter[str] = Counter()
    prints: Counter[str | None] = Counter()  # done samples per fingerprint
    first_done: dict[str, list[FileRecord]] = {}
    total_bytes = 0
    shards = ledger.read_all(out)
    every = [row for rows in shards.values() for row in rows.values()]
    scan = Scan.of(out, fmt)  # what its consumer would load: every row's files taken off it
    scan.owned(every)
    own = [row for row in every if row.fingerprint in (None, meta["fingerprint"])]  # not an overwrite's old samples
    for row in every:
        old = row.status == "done" and row.fingerprint not in (None, meta["fingerprint"])  # left to replace
        groups[group_name(row.group)]["to_replace" if old else row.status] += 1
        if row.reason:
            reasons[row.reason] += 1
        if row.status == "done":
            prints[row.fingerprint] += 1
        if row.status == "done" and not old:
            total_bytes += row.bytes or 0
            first_done.setdefault(row.group, row.output_files())
    samples = {}
    for group, files in sorted(first_done.items()):
        paths = [f.path for f in files]
        described = {f.path: {k: _describe(v) for k, v in _read(fmt, out, f).items()} for f in files}
        if len(paths) == 1:
            samples[group] = {"path": paths[0], **described[paths[0]]}
        else:  # a format that keeps a sample in several files (the LTX-2 layout: latents, conditions, audio)
            samples[group] = {"path": paths[0], "files": described}
    return {
        "out": str(out),
        "unfinished": unfinished,
        "fingerprint": meta["fingerprint"],
        "family": meta["spec"]["family"],
        "format": meta["spec"]["format"],
        "geometry": cache_geometries(out, meta["spec"], own),
        "buckets": [str(Bucket(*b)) for b in meta["spec"].get("buckets") or []],
        "recipe": meta.get("provenance", {}).get("recipe"),
        "consumer": written_for(meta["spec"]),
        **_policy_names(meta["spec"]),
        "groups": {g: dict(c) for g, c in sorted(groups.items())},
        "reasons": dict(reasons),
        "done": sum(c["done"] for c in groups.values()),
        "fingerprints": {str(fp): n for fp, n in prints.items()},
        "overwrite": overwrite_in_progress(meta, prints),
        "repeated_frames": repeated_frames(own),
        "bytes": total_bytes,
        "samples": samples,
        "unowned": scan.unowned(),
        **({"shards": shard_summary(out, fmt)} if isinstance(fmt, ShardFormat) else {}),
    }


def format_report(report: dict[str, Any]) -> str:
    """The inspect report as text."""
    lines = [
        f"cache        {report['out']}",
        f"fingerprint  {report['fingerprint']}",
        f"family       {report['family']}   format {report['format']}"
        + (f"   buckets (W×H×F) {';'.join(report['buckets'])}" if report["buckets"] else ""),
        *geometry_lines(report["geometry"][:1], indent="geometry     "),
        *geometry_lines(report["geometry"][1:], indent=" " * 13),
        f"recipe       {report['recipe'] or '(none: settings given one by one)'}   temporal {report['temporal']}"
        f"   resize {report['resize']}",
        f"written for  {report['consumer']['consumer']}",
        "  it sees    " + ", ".join(f"{k} {v}" for k, v in report["consumer"].items() if k != "consumer"),
        f"done         {report['done']} samples, {report['bytes']:,} bytes"
        + (f"; {report['repeated_frames']} with frames repeated to fill F" if report.get("repeated_frames") else ""),
    ]
    if report.get("unfinished"):
        lines.insert(
            1,
            f"unfinished   no cache.json yet: a run is writing it, or stopped before it ended; this is the spec it "
            f"declares ({PENDING_JSON}): the same build command finishes it",
        )
    overwrite = report.get("overwrite")
    if overwrite:
        lines.append(
            f"overwrite    in progress: {overwrite['pending']} of {overwrite['from'][:16]}…'s samples still to "
            "replace (approved; the same build command resumes it)"
        )
    replacing = f" {'to replace':>11}" if overwrite else ""
    lines += ["", f"{'group':<50} {'done':>6} {'skipped':>8} {'failed':>7}{replacing}"]
    for group, counts in report["groups"].items():
        old = f" {counts.get('to_replace', 0):>11}" if overwrite else ""
        lines.append(
            f"{group:<50} {counts.get('done', 0):>6} {counts.get('skipped', 0):>8} {counts.get('failed', 0):>7}{old}"
        )
    if "shards" in report:
        shards = report["shards"]
        prints = ", ".join(f"{fp[:16]}… in {n} file(s)" for fp, n in sorted(shards["fingerprints"].items()))
        lines += [f"shard files  {shards['files']} holding {shards['samples']} samples; fingerprints: {prints or '-'}"]
    if report["reasons"]:
        lines += ["", "reasons: " + ", ".join(f"{k} × {v}" for k, v in sorted(report["reasons"].items()))]
    unowned = report.get("unowned") or []
    if unowned:
        lines += ["", f"unowned      {len(unowned)} file(s) its consumer would load that no ledger row owns:"]
        lines += [f"  {report['out']}/{rel}" for rel in unowned[:20]]
        lines += [f"  ... and {len(unowned) - 20} more (--json lists them all)"] if len(unowned) > 20 else []
    for group, sample in report["samples"].items():
        lines += ["", f"sample of {group}: {sample['path']}"]
        for rel, record in (sample.get("files") or {sample["path"]: sample}).items():
            if "files" in sample:
                lines.append(f"  {rel}")
            lines += [f"  {k:<22} {v}" for k, v in record.items() if k not in ("path", "files")]
    return "\n".join(lines)
