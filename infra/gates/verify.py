"""The verify-existing report: `classify`, then the ledgers (what is done), every done row's file (there,
of its size; with ``content="all"`` its sha256 against the ledger, `infra.gates.content`) and a few done samples
loaded through the format's reader (``weights_only=True``) and hashed.

Existing files are read only as JSON or through that reader, so a planted pickle never runs; nothing is written.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from infra import outdir
from infra.cache import ledger, listing
from infra.cache.cachedir import OutKind, classify, overwrite_in_progress, read_cache_json
from infra.cache.ledger import FileRecord
from infra.config import TEMPORAL_ALIASES, CacheSpec
from infra.errors import ConfigError
from infra.formats import Format, get_format
from infra.gates.cachefiles import cache_files
from infra.gates.content import Content, ContentCheck, Damaged, problem, repair_commands, repair_lines
from infra.gates.stale import StaleReport, find_stale
from infra.gates.unowned import Scan, finished_shards, leftovers
from infra.job import Job
from infra.media.resize import resize_policy_of
from infra.models import get_family
from infra.plan import ShardPlan
from infra.records import DamagedRecord, warn
from infra.sources.names import group_name

logger = logging.getLogger(__name__)

MAX_LISTED = 20
#: Column headings of the preview's two-column tables (by section title); others are "what | value".
HEADERS: dict[str, tuple[str, str]] = {
    "What differs": ("field", "existing → planned"),
    "Done per group": ("group", "samples"),
    "Outputs": ("output", "state"),
    "Spec of the existing cache": ("field", "value"),
    "Changed in the source since encoded: stale": ("sample", "what changed"),
}
#: A state a build may write into without asking (but for unowned files: `VerifyReport.writable`).
WRITABLE = ("absent", "compatible")

CONSEQUENCES: dict[str, str] = {
    "absent": "A run creates OUT, writes cache.json, then encodes every planned sample.",
    "compatible": "A run resumes: done samples are kept (not decoded again), only the rest are encoded.",
    "incompatible": "Nothing is written: a run stops before taking the lock unless the conflict is resolved "
    "(another OUT, reuse of this spec, or an approved overwrite).",
    "foreign": "Nothing is written: latentforge does not write into a directory it did not create.",
    "damaged": "Nothing should be written until the problems are resolved (restore or remove the files; damaged "
    "samples: see Repair).",
    "unowned": "Nothing is written unless a person decides on the files no ledger row owns: keep them (reuse), have "
    "them removed (overwrite), write another OUT (new_dir); or move them out of OUT and run again.",
}


@dataclass
class VerifyReport:
    """What OUT holds, compared with the plan; ``problems`` lists every damage found, with its path."""

    kind: OutKind
    message: str
    out: str
    planned_fingerprint: str
    existing_fingerprint: str | None = None
    differences: dict[str, dict[str, Any]] = field(default_factory=dict)
    existing_spec: dict[str, Any] | None = None
    done: int = 0
    groups: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    outputs: dict[str, str] = field(default_factory=dict)
    sample_check: dict[str, Any] | None = None
    checked: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: Done in the ledger but gone from disk: not damage (nothing is there to overwrite); a run re-encodes them.
    missing: list[str] = field(default_factory=list)
    #: Done samples whose source changed since they were encoded (`infra.gates.stale`; a compatible OUT only).
    stale: list[dict[str, Any]] = field(default_factory=list)
    stale_kept: int = 0
    unrecorded_sources: int = 0
    #: Done samples whose files are not the bytes the ledger recorded (`infra.gates.content`): each is a problem too.
    damaged: list[dict[str, Any]] = field(default_factory=list)
    #: What checked the files' content: every byte (all) or the samples loaded (spot).
    content: str = "spot"
    #: Done samples per fingerprint, as the ledgers hold them (``done`` counts the cache's own).
    fingerprints: dict[str, int] = field(default_factory=dict)
    #: An approved overwrite half made (`infra.cache.cachedir.overwrite_in_progress`): what it replaces, what is left.
    overwrite: dict[str, Any] | None = None
    #: Shell lines that move the damaged files out of OUT; the build run again then encodes those samples again.
    repair: list[str] = field(default_factory=list)
    #: Files of OUT its format's consumer would load (by its own glob) that no ledger row owns, links among them
    #: (OUT-relative): a trainer would load them, so a build stops there until a person decides (`infra.gates.unowned`).
    unowned: list[str] = field(default_factory=list)
    #: Unowned files at the paths of samples of a shard a run left unfinished: its resume adopts or refuses each.
    in_flight: list[str] = field(default_factory=list)
    #: Unowned files this run's conflict decision covers (kept by reuse, removed by an approved overwrite).
    unowned_decided: list[str] = field(default_factory=list)

    @property
    def writable(self) -> bool:
        """A build may write into OUT without asking: absent or compatible, and no file a trainer would load that no
        ledger row owns (nor one a decision did not cover)."""
        return self.kind in WRITABLE and not self.unowned

    #: Records of OUT's treated as absent (a damaged recorded plan: the next build makes it again), one line each:
    #: the lines `reconcile` and a build give for them too.
    absent: list[str] = field(default_factory=list)

    def add_stale(self, found: StaleReport) -> None:
        """Take in the stale check of the plan's selection."""
        self.stale = [asdict(s) | {"selector": s.selector} for s in found.stale]
        self.stale_kept, self.unrecorded_sources = found.kept, found.unknown
        if self.stale and self.kind == "compatible":
            self.message += f"; {len(self.stale)} done sample(s) changed in the source since (stale: a run asks)"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data."""
        return asdict(self)

    def markdown(self) -> str:
        """The preview for a human approving in the Prefect UI."""
        lines = [f"## verify-existing: `{self.kind}`", "", _md(_short(self.message))]
        for title, rows in _sections(self):
            lines += ["", f"**{title}**", ""]
            if any(label for label, _ in rows):
                first, second = HEADERS.get(title.split(" (")[0], ("what", "value"))
                lines += [f"| {first} | {second} |", "|---|---|"]
                lines += [f"| {_md(label)} | {_md(_short(value))} |" for label, value in rows]
            else:
                lines += [f"* {_md(value)}" for _, value in rows]
        return "\n".join(lines) + "\n"

    def text(self) -> str:
        """The same preview for a terminal."""
        lines = [f"verify-existing: {self.kind.upper()} — {self.message}"]
        for title, rows in _sections(self):
            lines += ["", f"{title}:"]
            lines += [f"  {label}: {value}" if label else f"  {value}" for label, value in rows]
        return "\n".join(lines) + "\n"


def verify_out(
    out: Path,
    spec: CacheSpec,
    *,
    latent_shape: tuple[int, ...],
    text_shape: tuple[int, ...],
    max_samples: int = 8,
    extra_shapes: Mapping[str, tuple[int, ...]] | None = None,
    content: Content = "spot",
    planned: tuple[Job, list[ShardPlan]] | None = None,
    recorded: bool = False,
) -> VerifyReport:
    """Classify OUT against `spec`, count what the ledgers say is done and check the samples (read only): every
    file's sha256 with ``content="all"``, those of the samples loaded with ``"spot"``; the files its consumer would
    load that no ledger row owns (with the `planned` build: those a sample in progress when a run died left, and
    those its conflict decision covers, apart); with `recorded`, also whether OUT's recorded plan reads back
    (`latentforge verify`: a build records its own plan anew, and need not read it)."""
    out = outdir.root(out)
    state = classify(out, spec)
    fingerprints = {"planned_fingerprint": spec.fingerprint(), "existing_fingerprint": state.existing_fingerprint}
    report = VerifyReport(state.kind, state.message, str(out), differences=dict(state.differences), **fingerprints)
    report.content = content
    if state.kind not in ("absent", "foreign"):
        existing = _existing_spec(out)
        report.existing_spec = existing.model_dump(mode="json") if existing else None
        full = content == "all"
        scan = _scan(out, existing or spec, report)
        done = _done_rows(out, report, ContentCheck(out, full, "sha256" if full else "size"), scan)
        if scan is not None:
            _unowned(out, report, scan, planned)
        _check_contents(out, report)
        if recorded:
            _check_plan(out, report)
        shapes = {"latents": tuple(latent_shape), "text_embeddings": tuple(text_shape), **(extra_shapes or {})}
        if spec.buckets:  # each sample's latents have its own bucket's shape
            del shapes["latents"]
        if spec.text_storage == "trimmed":  # each sample's text has its own prompt's rows ([seq_len, D])
            del shapes["text_embeddings"]
        try:
            fmt = get_format((existing or spec).format, (existing or spec).family)
            chosen = _rows_of(out, _choose(done, max_samples))
            _check_samples(out, fmt, chosen, _expected(spec, fmt, shapes), report)
            if not full:  # the samples just loaded, hashed too: a cheap look at content before a resume
                spot = ContentCheck(out, files=True, parts=None)
                _add_damaged(out, report, [d for row in chosen for d in spot.row(row)])
        except ConfigError as exc:
            report.problems.append(f"cannot read samples: {exc}")
        _settle(report)
    logger.info("verify-existing %s: %s (%d problem(s))", out, report.kind, len(report.problems))
    return report


def verify_plan(
    job: Job,
    shards: list[ShardPlan],
    spool: Path | None = None,
    *,
    stale: bool = True,
    content: Content = "spot",
    recorded: bool = False,
) -> VerifyReport:
    """`verify_out` for a plan's OUT; for a compatible OUT (a resume), also the stale samples of the plan's `shards`
    (`find_stale`: against the plan's listing in `spool`, else a pass over the source's listing; `stale=False`
    leaves it out). A build's verify-existing checks content by `"spot"`:
    hashing every byte of a large cache before each resume would cost more than most resumes encode."""
    shapes = {"latent_shape": job.latent_shape, "text_shape": job.text_shape}
    report = verify_out(job.out, job.spec, **shapes, content=content, planned=(job, shards), recorded=recorded)
    if stale and report.kind == "compatible":
        report.add_stale(find_stale(job, shards, spool))
    return report


def _existing_spec(out: Path) -> CacheSpec | None:
    try:
        return CacheSpec.model_validate(read_cache_json(out)["spec"])
    except (OSError, ValueError, KeyError, TypeError, ValidationError):
        return None


@dataclass(frozen=True)
class _Done:
    """What choosing the samples to load needs of a done row (a cache of 10^6 samples holds 10^6 of these, not
    10^6 ledger rows: verify reads the ledgers shard by shard)."""

    group: str
    path: str
    key: str
    shard: str


def _scan(out: Path, spec: CacheSpec, report: VerifyReport) -> Scan | None:
    """The files the cache's consumer loads (`infra.gates.unowned`); None (a problem said) when OUT cannot be listed."""
    try:
        return Scan.of(out, get_format(spec.format))
    except (ConfigError, OSError, outdir.UnsafePath) as exc:
        report.problems.append(f"{out}: not listed for the files its consumer loads ({exc})")
        return None


def _unowned(out: Path, report: VerifyReport, scan: Scan, planned: tuple[Job, list[ShardPlan]] | None) -> None:
    """The unowned files of `scan` into the report: links (damage: a consumer would follow them), those a run left
    for a sample of a shard it did not finish (`leftovers`, with the `planned` build), those the planned build's
    conflict decision covers, and the rest (`unowned`)."""
    report.problems += [
        f"{out / rel} is a symbolic link its consumer would follow: latentforge never reads, writes or uploads under "
        "OUT through a link (replace it with the real folder or file, or move it out of OUT)"
        for rel in scan.links
    ]
    found = scan.files()
    if not found or planned is None:
        report.unowned = found
        return
    job, shards = planned
    report.in_flight = sorted(leftovers(job, shards, finished_shards(out), found))
    decided = job.keep_unowned | job.remove_unowned
    rest = [rel for rel in found if rel not in report.in_flight]
    report.unowned_decided = [rel for rel in rest if rel in decided]
    report.unowned = [rel for rel in rest if rel not in decided]


def _done_rows(out: Path, report: VerifyReport, content: ContentCheck, scan: Scan | None = None) -> list[_Done]:
    """Done rows of every shard (latest row per key), shard by shard: each one's files checked (`_check_files`,
    then `content`), done and groups filled, every row's files taken off `scan`; what `_choose` needs kept of each."""
    done: list[_Done] = []
    counted: set[str] = set()  # a shard file holds many samples: its bytes count once
    prints: Counter[str | None] = Counter()
    try:
        for shard_id in ledger.shard_ids(out):
            every = ledger.read_shard(out, shard_id)
            if scan is not None:
                scan.owned(every.values())
            rows = [row for row in every.values() if row.status == "done"]
            _check_files(out, rows, report, counted)
            _add_damaged(out, report, [d for row in rows for d in content.row(row)])
            prints.update(row.fingerprint for row in rows)
            own = [r for r in rows if report.existing_fingerprint in (None, r.fingerprint) or r.fingerprint is None]
            done += [_Done(row.group, row.path or "", row.key, shard_id) for row in own]
    except DamagedRecord as exc:  # one line: the file, its line, and what repairs it
        report.problems.append(f"unreadable ledger {exc}")
    except (OSError, ValueError) as exc:
        report.problems.append(f"{ledger.ledger_dir(out)}: unreadable ledger ({exc})")
    except outdir.UnsafePath as exc:
        report.problems.append(str(exc))
    report.done = len(done)
    report.groups = dict(sorted(Counter(d.group for d in done).items()))
    _count_fingerprints(out, report, prints)
    return done


def _count_fingerprints(out: Path, report: VerifyReport, prints: Counter[str | None]) -> None:
    """Done samples per fingerprint; the approved overwrite in progress, if one is; done rows of any other
    fingerprint are a problem (a cache mixed from two specs that nobody approved)."""
    report.fingerprints = {str(fp): n for fp, n in prints.items()}
    try:
        meta = read_cache_json(out)
    except (OSError, ValueError, outdir.UnsafePath):
        return
    if not isinstance(meta, dict) or report.existing_fingerprint is None:
        return  # an unreadable cache.json: damage, said already by its classification
    report.overwrite = overwrite_in_progress(meta, prints)
    expected = {None, report.existing_fingerprint, (report.overwrite or {}).get("from")}
    for fp, n in prints.items():
        if fp not in expected:
            report.problems.append(
                f"ledger: {n} done sample(s) written for fingerprint {fp}, neither this cache's nor one an approved "
                "overwrite replaces"
            )


def _add_damaged(out: Path, report: VerifyReport, found: list[Damaged]) -> None:
    """Record damaged samples (each also a problem) and the repair of all found so far."""
    known = {(d["selector"], d["path"]) for d in report.damaged}
    fresh = [d for d in found if (d.selector, d.path) not in known]
    if fresh:
        report.problems += [problem(d, out) for d in fresh]
        report.damaged += [{**asdict(d), "selector": d.selector} for d in fresh]
        report.repair = repair_commands(out, [d["path"] for d in report.damaged])


def _check_contents(out: Path, report: VerifyReport) -> None:
    """The rest of what the cache is (`cache_files`: ledgers, reports, kept specs) reached without a link: what
    upload refuses, verify calls damage."""
    try:
        cache_files(out)
    except outdir.UnsafePath as exc:
        report.problems.append(str(exc))


def _check_plan(out: Path, report: VerifyReport) -> None:
    """OUT's recorded plan, read back as `reconcile` and a build read it: what does not read back is treated as
    absent by all three (the next build records it anew), with the same line (`infra.cache.listing.ABSENT`)."""
    for exc in listing.recorded_damage(out):
        warn(exc)
        report.absent.append(str(exc))


def _rows_of(out: Path, chosen: list[_Done]) -> list[ledger.LedgerRow]:
    """The ledger rows of the chosen samples, in order (their shards read again: a few)."""
    shards = {shard_id: ledger.read_shard(out, shard_id) for shard_id in dict.fromkeys(d.shard for d in chosen)}
    return [shards[d.shard][d.key] for d in chosen]


def _stat(out: Path, relpath: str | None) -> os.stat_result | str | None:
    """What is at a ledger's OUT-relative path, through the door (`infra.outdir`): its stat; why it is refused (a
    path outside OUT, a symbolic link on the way: the same refusal upload gives); None when it is not there."""
    try:
        if not relpath or not outdir.parts(relpath):
            raise outdir.UnsafePath("names no file")
    except outdir.UnsafePath:
        return f"has a path outside OUT ({relpath!r})"
    try:
        return outdir.lstat(out, relpath)
    except outdir.UnsafePath as exc:
        return f"has a path through a link ({exc})"


def _check_files(out: Path, rows: list[ledger.LedgerRow], report: VerifyReport, counted: set[str]) -> None:
    """Every file of every done row exists with the ledger's size; bytes sums what is there (a shard file's once:
    `counted` holds those already summed)."""
    for row in rows:
        files = row.output_files()
        if not files:
            report.problems.append(f"ledger/{row.shard}: done row {row.key!r} names no output file")
        for file in files:
            found, path = _stat(out, file.path), out / file.path
            if isinstance(found, str):
                report.problems.append(f"ledger/{row.shard}: done row {row.key!r} {found}")
            elif found is None or not stat.S_ISREG(found.st_mode):
                report.missing.append(str(path))
            elif file.member is not None:  # a sample inside a shard file: the member is read by _check_samples
                if file.path not in counted:
                    counted.add(file.path)
                    report.bytes += found.st_size
            else:
                report.bytes += found.st_size
                if found.st_size != file.bytes:
                    report.problems.append(f"{path}: {found.st_size} bytes on disk, {file.bytes} in ledger/{row.shard}")


def _choose(rows: list[_Done], limit: int) -> list[_Done]:
    """Up to `limit` rows, round-robin over the groups in sorted order (deterministic)."""
    by_group: dict[str, list[_Done]] = defaultdict(list)
    for row in sorted(rows, key=lambda r: (r.group, r.path, r.key)):
        by_group[row.group].append(row)
    queues = [by_group[group] for group in sorted(by_group)]
    chosen = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
    return chosen[: max(limit, 0)]


def _load(fmt: Format, out: Path, file: FileRecord, report: VerifyReport) -> dict[str, Any] | None:
    """The sample through the format's safe reader, or None with the problem recorded."""
    path = out / file.path
    try:
        record = fmt.read_file(out, file)
    except Exception as exc:  # noqa: BLE001 - any failure to load is damage, reported with its path
        text = str(exc)
        reason = " ".join(text[max(text.find("WeightsUnpickler error:"), 0) :].split())[:160]
        report.problems.append(f"{path}: does not load with weights_only=True ({type(exc).__name__}: {reason})")
        return None
    if not isinstance(record, dict):
        report.problems.append(f"{path}: holds a {type(record).__name__}, not a dict of tensors")
        return None
    return record


def _expected(spec: CacheSpec, fmt: Format, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, dict[str, Any]]:
    """Per output kind the family stores: the format's key for it, the planned shape (None: not planned) and the
    stored dtype. A kind the format has no key for is a ConfigError (a family and a format that do not fit)."""
    kinds = get_family(spec.family).kinds(spec)
    keys = fmt.keys_for(spec.family)
    unknown = [kind for kind in kinds if kind not in keys]
    if unknown:
        raise ConfigError(f"format {fmt.name} has no place for {', '.join(unknown)} (family {spec.family})")
    trimmed = {"text_embeddings"} if fmt.trims_text_for(spec.family) else set()  # stored [seq_len, D]: no planned shape
    return {
        kind: {
            "key": keys[kind],
            "label": fmt.label(kind, spec.family),
            "shape": list(shapes[kind]) if kind in shapes and kind not in trimmed else None,
            "dtype": str(fmt.stored_dtype(kind, spec.store_dtype)),
        }
        for kind in kinds
    }


def _check_samples(
    out: Path, fmt: Format, rows: list[ledger.LedgerRow], want: dict[str, dict[str, Any]], report: VerifyReport
) -> None:
    """Load the chosen samples (every file of each); judge each output kind in the file that holds it; keep the
    first loaded sample's shape check. A kind the row records as missing (a clip without audio) is not looked for."""
    holding, expected = dict.fromkeys(want, 0), dict.fromkeys(want, 0)
    for row in rows:
        found = {f.path: _stat(out, f.path) for f in row.output_files()}
        if not found or not all(isinstance(st, os.stat_result) and stat.S_ISREG(st.st_mode) for st in found.values()):
            continue  # already reported by _check_files
        files = {rel: out / rel for rel in found}
        report.checked.append(row.path or "")
        records = {f.path: _load(fmt, out, f, report) for f in row.output_files()}
        if any(r is None for r in records.values()):
            continue
        for rel, record in records.items():
            stored = (record or {}).get("fingerprint")
            if report.existing_fingerprint and isinstance(stored, str) and stored != report.existing_fingerprint:
                report.problems.append(f"{files[rel]}: written for fingerprint {stored}, not this cache's")
        found: dict[str, Any] = {}
        for kind, target in want.items():
            file = row.file_of(kind)
            if kind in row.missing or file is None:
                continue
            expected[kind] += 1
            value = (records.get(file.path) or {}).get(target["key"])
            if torch.is_tensor(value):
                holding[kind] += 1
                found[target["label"]] = value
            else:
                report.problems.append(f"{files[file.path]}: no {target['key']!r} tensor ({kind})")
        if report.sample_check is None:
            labelled = {v["label"]: v for k, v in want.items() if k not in row.missing}
            report.sample_check = _sample_check(row.path or "", found, labelled)
    report.outputs = {
        kind: "present" if expected[kind] and n == expected[kind] else "missing" for kind, n in holding.items()
    }


def _sample_check(relpath: str, found: Mapping[str, Any], want: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each output's shape and dtype (by its label), against the planned shapes and the stored dtype."""
    tensors = {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in found.items()}
    planned = {label: {"shape": t["shape"], "dtype": t["dtype"]} for label, t in want.items()}
    differs: dict[str, dict[str, Any]] = {}
    for label, target in planned.items():
        have = tensors.get(label, {})
        for attr in ("shape", "dtype"):
            if target[attr] is not None and have.get(attr) != target[attr]:
                differs[f"{label}.{attr}"] = {"existing": have.get(attr), "planned": target[attr]}
    return {"path": relpath, "tensors": tensors, "planned": planned, "matches": not differs, "differs": differs}


def _settle(report: VerifyReport) -> None:
    """Any problem makes the report damaged; a compatible cache says how much is done."""
    check = report.sample_check
    if report.kind == "compatible" and check is not None and not check["matches"]:
        report.problems.append(f"{check['path']}: differs from the plan with the same fingerprint: {check['differs']}")
    counts = f"{report.done} sample(s) done in {len(report.groups)} group(s)"
    fields = [label for label, _ in difference_rows(report.differences)]  # model_identity per component
    differs = f"; differs in: {', '.join(fields)}" if fields else ""
    if report.problems and report.kind != "damaged":
        report.kind = "damaged"
        report.message = f"{report.out}: {len(report.problems)} problem(s), first: {report.problems[0]}{differs}"
    elif report.kind == "compatible":
        gone = f", {len(report.missing)} of them missing on disk (re-encoded by the run)" if report.missing else ""
        resumes = "" if report.unowned else ": a run resumes"
        report.message = f"{report.out} holds this cache, {counts}{gone}{resumes}"
        if report.overwrite:
            report.message += f" the approved overwrite ({_overwrite_text(report.overwrite)})"
    elif report.kind == "incompatible":
        report.message = f"{report.out} holds another cache ({counts}){differs}"
    if report.unowned:
        first = f"{report.out}/{report.unowned[0]}"
        report.message += (
            f"; {len(report.unowned)} file(s) its consumer would load that no ledger row owns (first: {first}): a "
            "build stops there until a person decides"
        )
    if report.damaged:
        report.message += f"; {len(report.damaged)} damaged sample(s): `latentforge verify OUT` prints their repair"


def _overwrite_text(overwrite: dict[str, Any]) -> str:
    return f"{overwrite['pending']} sample(s) of {overwrite['from'][:16]}… still to replace"


def _flat(name: str, value: Any) -> list[tuple[str, str]]:
    """A spec field as rows: a dict field gives one row per component."""
    if isinstance(value, dict):
        return [(f"{name}.{k}", str(v)) for k, v in sorted(value.items())]
    return [(name, str(value))]


def flag_words(name: str, value: Any) -> Any:
    """A spec field's value as its flag spells it: ``temporal`` and ``resize`` by their policy names (``span``,
    ``stretch``, as `inspect` shows them), not the values the spec stores (``linspace``,
    ``bilinear-align_corners_false``); any other field as it is."""
    if name == "temporal" and isinstance(value, str):
        return TEMPORAL_ALIASES.get(value, value)
    if name == "resize" and isinstance(value, str):
        return resize_policy_of(value)
    return value


def difference_rows(differences: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
    """One row per differing field, or per differing component of a dict field."""
    rows = []
    for name, pair in differences.items():
        old = dict(_flat(name, flag_words(name, pair["existing"])))
        new = dict(_flat(name, flag_words(name, pair["planned"])))
        changed = [k for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]
        rows += [(k, f"{old.get(k, '-')} → {new.get(k, '-')}") for k in changed]
    return rows


def _sections(report: VerifyReport) -> list[tuple[str, list[tuple[str, str]]]]:
    """What is there, what differs, what would change: shared by markdown() and text()."""
    cache = [("OUT", report.out), ("samples done", str(report.done)), ("bytes", f"{report.bytes:,}")]
    cache += [("existing fingerprint", str(report.existing_fingerprint)), ("planned", report.planned_fingerprint)]
    if len(report.fingerprints) > 1 or report.overwrite:
        cache += [(f"done of {fp[:16]}…", str(n)) for fp, n in sorted(report.fingerprints.items())]
    if report.overwrite:
        cache.append(
            ("overwrite in progress", f"{_overwrite_text(report.overwrite)} (a build of this spec resumes it)")
        )
    groups = [(group_name(g), str(n)) for g, n in report.groups.items()]
    sections = [("Cache", cache), ("Done per group", groups)]
    sections.append(("What differs (existing → planned)", difference_rows(report.differences)))
    sections.append(("Outputs", list(report.outputs.items())))
    if report.sample_check:
        check = report.sample_check
        rows = [("path", check["path"]), ("matches the plan", "yes" if check["matches"] else "no")]
        rows += [(k, f"{t['shape']} {t['dtype']}") for k, t in check["tensors"].items()]
        rows += [(f"differs: {k}", f"{d['existing']} → {d['planned']}") for k, d in check["differs"].items()]
        sections.append((f"Sample check (of {len(report.checked)} read with weights_only=True)", rows))
    problems = [("", p) for p in report.problems[:MAX_LISTED]]
    if len(report.problems) > MAX_LISTED:
        problems.append(("", f"... and {len(report.problems) - MAX_LISTED} more"))
    sections.append((f"Problems ({len(report.problems)})", problems))
    repair = [("", line) for line in repair_lines(report.repair, report.content, MAX_LISTED)]
    sections.append((f"Repair ({len(report.damaged)} damaged sample(s))", repair))
    gone = [("", p) for p in report.missing[:MAX_LISTED]]
    sections.append((f"Missing on disk, re-encoded by a run ({len(report.missing)})", gone))
    stale = [(s["selector"], ", ".join(f"{k}: {v}" for k, v in s["changed"].items())) for s in report.stale]
    sections.append((f"Changed in the source since encoded: stale ({len(report.stale)})", stale[:MAX_LISTED]))
    sections += _unowned_sections(report)
    notes = [("kept stale by an earlier decision", str(report.stale_kept))] if report.stale_kept else []
    notes += (
        [("done rows with no recorded source", str(report.unrecorded_sources))] if report.unrecorded_sources else []
    )
    sections.append(("Source identity", notes))
    sections.append(("Treated as absent (made again by the next build)", [("", line) for line in report.absent]))
    spec = report.existing_spec or {}
    rows = [row for k, v in sorted(spec.items()) for row in _flat(k, flag_words(k, v))]
    sections.append(("Spec of the existing cache", rows))
    what = "unowned" if report.unowned and report.kind in WRITABLE else report.kind
    sections.append(("What would change", [("", CONSEQUENCES[what])]))
    return [(title, rows) for title, rows in sections if rows]


def _unowned_sections(report: VerifyReport) -> list[tuple[str, list[tuple[str, str]]]]:
    """The files a trainer would load that no ledger row owns; those a killed run left; those a decision covers."""

    def listed(rels: list[str]) -> list[tuple[str, str]]:
        rows = [("", f"{report.out}/{rel}") for rel in rels[:MAX_LISTED]]
        return rows + (
            [("", f"... and {len(rels) - MAX_LISTED} more (--json lists them all)")] if len(rels) > MAX_LISTED else []
        )

    return [
        (
            f"Unowned: files its consumer would load that no ledger row owns ({len(report.unowned)})",
            listed(report.unowned),
        ),
        (
            f"Left by a run that did not finish its shard: the resume adopts or refuses each ({len(report.in_flight)})",
            listed(report.in_flight),
        ),
        (f"Unowned, covered by this run's decision ({len(report.unowned_decided)})", listed(report.unowned_decided)),
    ]


def _md(value: str) -> str:
    """Escape a table cell."""
    return value.replace("|", "\\|").replace("\n", " ")


_DIGEST = re.compile(r"\b([0-9a-f]{16})[0-9a-f]{16,}\b")


def _short(value: str) -> str:
    """For the UI's dialog: hex digests cut to their first 16 digits, so they do not run off it. Paths are kept as
    they are, with nothing invisible in them: a person copies them into a shell (the text and JSON forms keep
    digests whole too)."""
    return _DIGEST.sub(r"\1…", value)
