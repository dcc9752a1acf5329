"""The run summary: counts by status and reason, bytes, timings, shapes, where the cache is."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel

from infra.preprocess.shard_result import ShardResult
from infra.sources import retries


def geometry_lines(geometries: list[dict[str, Any]], *, indent: str) -> list[str]:
    """One line per geometry: F×H×W, its samples, and the tensors of its outputs (the format's own key names)."""
    lines = []
    for g in geometries:
        tensors = ", ".join(
            f"{k} {v['shape']} {v['dtype']}" for k, v in g["outputs"].items() if isinstance(v, dict) and "shape" in v
        )
        lines.append(f"{indent}F×H×W {g['frames']}×{g['height']}×{g['width']}: {g['samples']} sample(s); {tensors}")
    return lines


#: Rotated clips named in a summary's line (the run report lists every one).
NAMED_ROTATED = 5
#: What a clip with a display matrix is under each ``--rotate``, and the flag that changes it.
ROTATE_WORDS = {
    "stored": ("encoded as stored, on their side", "--rotate auto turns them upright"),
    "auto": ("turned upright by their display matrix", "--rotate stored keeps them as stored"),
}


def rotation_line(rotated: dict[str, Any]) -> str:
    """One line naming the clips a display matrix turns, what was done with them and the flag that changes it ("" for
    none)."""
    clips = rotated.get("clips") or {}
    if not clips:
        return ""
    done, change = ROTATE_WORDS[rotated.get("rotate") or "stored"]
    named = ", ".join(f"{clip} ({degrees}°)" for clip, degrees in list(clips.items())[:NAMED_ROTATED])
    more = f" and {len(clips) - NAMED_ROTATED} more (the run report lists them)" if len(clips) > NAMED_ROTATED else ""
    return f"rotation    {len(clips)} clip(s) with a display matrix {done} ({change}): {named}{more}"


class BuildSummary(BaseModel):
    """What a build did, for the terminal, the artifacts and the run report."""

    out: str
    fingerprint: str
    family: str
    samples: int
    done: int
    skipped: int
    failed: int
    encoded: int
    reused: int
    stale_kept: int = 0
    stale_undecided: int = 0
    text_calls: int = 0
    prompts_encoded: int = 0
    reasons: dict[str, int]
    shard_errors: dict[str, str]
    bytes: int
    seconds: float
    #: Each geometry the cache's done samples have, with every output key as the format wrote it
    #: (`infra.audit.inspect.cache_geometries`): a bucketed cache has several.
    geometries: list[dict[str, Any]] = []
    #: Done samples with fewer frames than their geometry: frames repeated to fill it (a 1-frame clip at 17).
    repeated_frames: int = 0
    #: Of `samples`, rows of the ledger whose source file is gone since (kept; reconciliation lists them).
    gone_from_source: int = 0
    run_id: str | None = None  # the flow run: what `latentforge rerun` takes
    #: A store's transient errors retried (`infra.sources.retries`), by kind: the shards' and the flow's own reads'.
    store_retries: dict[str, int] = {}
    #: Done samples of clips with a display matrix (``clips``: ``group/id`` → degrees counter-clockwise) and the
    #: spec's ``rotate`` (``stored``: on their side as stored; ``auto``: turned upright).
    rotated: dict[str, Any] = {}

    @property
    def bytes_per_sample(self) -> float:
        return self.bytes / self.done if self.done else 0.0

    @property
    def seconds_per_encoded_sample(self) -> float:
        return self.seconds / self.encoded if self.encoded else 0.0

    def table(self) -> list[dict[str, Any]]:
        """Rows for a table artifact."""
        rows = [
            {"what": k, "value": v}
            for k, v in (
                ("samples", self.samples),
                ("done", self.done),
                ("skipped", self.skipped),
                ("failed", self.failed),
                ("encoded this run", self.encoded),
                ("reused", self.reused),
                ("bytes", self.bytes),
                ("bytes/sample", round(self.bytes_per_sample)),
                ("seconds", self.seconds),
                ("s/encoded sample", round(self.seconds_per_encoded_sample, 3)),
            )
        ]
        rows += [{"what": "geometry", "value": line.strip()} for line in geometry_lines(self.geometries, indent="")]
        if self.repeated_frames:
            rows.append({"what": "frames repeated", "value": self.repeated_frames})
        if line := rotation_line(self.rotated):
            rows.append({"what": "rotated clips", "value": line.removeprefix("rotation").strip()})
        rows += [{"what": f"reason: {r}", "value": n} for r, n in sorted(self.reasons.items())]
        rows += [{"what": f"shard error: {s}", "value": e} for s, e in sorted(self.shard_errors.items())]
        rows += [{"what": f"store retries: {k}", "value": n} for k, n in self.store_retries.items()]
        return rows

    def text(self) -> str:
        """A few lines for a terminal."""
        lines = [
            f"cache       {self.out}",
            f"fingerprint {self.fingerprint[:16]}…  family {self.family}",
            f"samples     {self.samples}: {self.done} done ({self.encoded} encoded now, {self.reused} reused), "
            f"{self.skipped} skipped, {self.failed} failed",
            *(
                [
                    f"            {self.samples - self.gone_from_source} in the source now; {self.gone_from_source} "
                    "gone from it since encoded, kept in the cache (listed by reconcile)"
                ]
                if self.gone_from_source
                else []
            ),
            *geometry_lines(self.geometries[:1], indent="geometry    "),
            *geometry_lines(self.geometries[1:], indent=" " * 12),
            f"bytes       {self.bytes:,} total, {self.bytes_per_sample:,.0f} per sample",
            f"time        {self.seconds:.1f} s, {self.seconds_per_encoded_sample:.2f} s per encoded sample",
        ]
        if self.repeated_frames:
            lines.append(
                f"frames      {self.repeated_frames} sample(s) had fewer frames than their geometry: frames repeated "
                "to fill it (a still clip becomes a still video)"
            )
        if line := rotation_line(self.rotated):
            lines.append(line)
        if self.text_calls:
            calls = f"{self.text_calls} text-encoder call(s)"
            lines.append(f"text        {self.prompts_encoded} prompt(s) encoded in {calls}")
        if self.stale_kept or self.stale_undecided:
            lines.append(
                f"stale       {self.stale_kept} kept by decision, {self.stale_undecided} changed in the source during "
                "this run (kept as they were; the next run asks)"
            )
        if self.store_retries:
            kinds = ", ".join(f"{n} {kind}" for kind, n in self.store_retries.items())
            lines.append(f"store       {sum(self.store_retries.values())} transient error(s) retried ({kinds})")
        lines += [f"  {n:>5} × {reason}" for reason, n in sorted(self.reasons.items())]
        lines += [f"  shard {s}: {e}" for s, e in sorted(self.shard_errors.items())]
        if self.failed:
            lines.append(f"retry       the failed samples: latentforge rerun {self.run_id or 'RUN_ID'} --failed-only")
        return "\n".join(lines)


def summarize(
    results: Iterable[ShardResult],
    *,
    out: str,
    fingerprint: str,
    family: str,
    geometries: list[dict[str, Any]],
    repeated_frames: int,
    seconds: float,
    rotated: dict[str, Any] | None = None,
    run_id: str | None = None,
    own_retries: dict[str, int] | None = None,
) -> BuildSummary:
    """Add up shard results (`own_retries`: the store retries of the flow's own reads, listing and sanity)."""
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    encoded = reused = total_bytes = stale_kept = stale_undecided = text_calls = prompts_encoded = 0
    errors: dict[str, str] = {}
    store_retries = dict(own_retries or {})
    for r in results:
        counts.update(r.counts)
        reasons.update(r.reasons)
        encoded, reused, total_bytes = encoded + r.encoded, reused + r.reused, total_bytes + r.bytes
        stale_kept, stale_undecided = stale_kept + r.stale_kept, stale_undecided + r.stale_undecided
        text_calls, prompts_encoded = text_calls + r.text_calls, prompts_encoded + r.prompts_encoded
        store_retries = retries.add(store_retries, r.store_retries)
        if r.error:
            errors[r.shard] = r.error
    return BuildSummary(
        out=out,
        fingerprint=fingerprint,
        family=family,
        samples=sum(counts.values()),
        done=counts["done"],
        skipped=counts["skipped"],
        failed=counts["failed"],
        encoded=encoded,
        reused=reused,
        stale_kept=stale_kept,
        stale_undecided=stale_undecided,
        text_calls=text_calls,
        prompts_encoded=prompts_encoded,
        reasons=dict(reasons),
        shard_errors=errors,
        bytes=total_bytes,
        seconds=round(seconds, 3),
        geometries=geometries,
        repeated_frames=repeated_frames,
        run_id=run_id,
        store_retries=store_retries,
        rotated=rotated or {},
    )
