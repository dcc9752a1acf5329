"""What a cache is on disk besides its samples (which its ledger rows name): ``cache.json``, the sealed ledgers and
a shard format's part records, its ``_meta.json``, the specs of replaced caches and the reports latentforge wrote.
Found through the door (`infra.outdir`): a link among them is refused (`UnsafePath`), so verify and upload judge
one OUT the same way, and upload sends only these and the samples, never another file that happens to be in OUT.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from infra import outdir
from infra.cache.cachedir import CACHE_JSON
from infra.cache.ledger import LEDGER_DIR
from infra.cache.listing import PLAN_PATHS
from infra.formats.shards import META_JSON
from infra.gates.conflicts import KEPT_SPEC
from infra.report_files import REPORTS_DIR, UNPUBLISHED_REPORTS, written_here
from infra.storage import TEMP_SUFFIX

logger = logging.getLogger(__name__)

JOURNAL_SUFFIX = ".journal.jsonl"


@dataclass
class CacheFiles:
    """OUT-relative paths of the cache's files besides its samples, each a regular file reached without a link."""

    ledgers: list[str] = field(default_factory=list)  # sealed ledgers, part records
    journals: list[str] = field(default_factory=list)  # unsealed: a run in progress or killed
    #: The recorded plan (`infra.cache.listing`): the build's working record, which names the source's local paths;
    #: not published (the sealed ledgers hold a row for each planned sample).
    plan: list[str] = field(default_factory=list)
    reports: list[str] = field(default_factory=list)  # the reports latentforge wrote (upload reports left out)
    kept_specs: list[str] = field(default_factory=list)  # cache.<fingerprint>.json of a replaced cache
    meta: str | None = None  # a shard format's _meta.json
    others: list[str] = field(default_factory=list)  # in reports/ or cache.*.json, not written by latentforge


def _mine(name: str) -> bool:
    return not name.rpartition("/")[2].endswith(TEMP_SUFFIX)  # a killed writer's temp file is not the cache


def cache_files(out: Path) -> CacheFiles:
    """The cache's files besides its samples; UnsafePath (one line, naming it) for a link in the ledger or report
    folders, at cache.json, _meta.json or a ``cache.*.json``, or on the way to any of them."""
    found = CacheFiles()
    for rel in filter(_mine, outdir.files(out, LEDGER_DIR)):
        if rel.startswith(PLAN_PATHS):
            found.plan.append(rel)
        else:
            (found.journals if rel.endswith(JOURNAL_SUFFIX) else found.ledgers).append(rel)
    for rel in filter(_mine, outdir.files(out, REPORTS_DIR)):
        inside = rel.removeprefix(f"{REPORTS_DIR}/")
        if written_here(inside):
            if not inside.startswith(UNPUBLISHED_REPORTS):
                found.reports.append(rel)
        else:
            found.others.append(rel)
    for entry in outdir.entries(out):
        if entry.name == CACHE_JSON or not (entry.name.startswith("cache.") and entry.name.endswith(".json")):
            continue
        if outdir.is_file(out, entry.name):  # a link: UnsafePath
            (found.kept_specs if KEPT_SPEC.fullmatch(entry.name) else found.others).append(entry.name)
    outdir.lstat(out, CACHE_JSON)  # a link: UnsafePath
    found.meta = META_JSON if outdir.is_file(out, META_JSON) else None
    if found.others:
        logger.info("%s: %d file(s) not written by latentforge are not part of the cache", out, len(found.others))
    return found
