"""Files a trainer would load from OUT that the ledger does not know (DESIGN, invariant 10).

A format declares its consumer's own glob (`infra.formats.base.Format.consumer_glob`: musubi-tuner's
``*_wan.safetensors``, DiffSynth-Studio's every ``.pth``, ...). `Scan` lists the files of OUT that glob matches, once,
and every ledger row read takes its own files off the list: what is left, and every link among the names the consumer
reaches, is unowned. A trainer pointed at OUT would load those too, so verify, reconcile and inspect name them, and a
build stops at them like at any other conflict: a person keeps them (``reuse``), has them removed (an approved
``overwrite``), writes elsewhere (``new_dir``) or stops.

One kind of unowned file is not a stop: a file a run wrote for a sample just before it died, its row not yet in the
journal. Its sample's in-progress mark is still there with no row after it (`infra.cache.ledger`), and the resume
adopts the file (this spec's, for that sample) or records why not. `leftovers` finds those among the unowned files,
for a plan that can list its shards again: only shards with such marks, and only when some file is unowned.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from infra import outdir
from infra.cache.ledger import LedgerRow, Marks
from infra.errors import LatentforgeError
from infra.formats import Format, get_format
from infra.job import Job
from infra.plan import ShardPlan
from infra.sources import open_source

logger = logging.getLogger(__name__)


@dataclass
class Scan:
    """The files of OUT its consumer loads, less those the ledger rows read so far own."""

    out: outdir.Out
    fmt: Format
    left: set[str] = field(default_factory=set)
    links: list[str] = field(default_factory=list)
    #: Shard → keys of samples in progress when a run died (a mark with no row after it).
    pending: dict[str, set[str]] = field(default_factory=dict)

    @classmethod
    def of(cls, out: outdir.Out, fmt: Format) -> Scan:
        """One listing of what the consumer loads from OUT."""
        found = fmt.consumer_glob.files(out)
        return cls(out, fmt, set(found.files), list(found.links))

    def owned(self, shard_id: str, rows: Iterable[LedgerRow], marks: Marks | None = None) -> None:
        """Take the files `rows` name off the list; note the shard's samples left in progress (`marks`)."""
        for row in rows:
            for file in row.output_files():
                self.left.discard(file.path)
        if marks:
            self.pending.setdefault(shard_id, set()).update(marks)

    def unowned(self) -> list[str]:
        """Every unowned file and link, OUT-relative, sorted."""
        return sorted(self.left | set(self.links))


def leftovers(job: Job, shards: list[ShardPlan], pending: dict[str, set[str]], unowned: Iterable[str]) -> set[str]:
    """The `unowned` files that a sample in progress when a run died writes (`pending`: shard → keys): its shard
    listed again (only a shard with such a sample) to name the sample's files. A shard that cannot be listed explains
    none."""
    left = set(unowned)
    wanted = {shard.id: shard for shard in shards if pending.get(shard.id)}
    if not left or not wanted:
        return set()
    fmt, found = get_format(job.spec.format), set()
    source = open_source(job.source, job.spec, job.limits)
    for shard_id, shard in wanted.items():
        keys = pending[shard_id]
        try:
            with contextlib.closing(source.samples(shard.shard)) as refs:
                for ref in refs:
                    stems = [_stem(ref.key, ref.stem, key) for key in keys]
                    found |= {rel for stem in stems if stem for rel in left if fmt.sample_file(stem, job.kinds, rel)}
        except (LatentforgeError, OSError, ValueError) as exc:  # damaged or gone: its files stay unowned
            logger.warning(
                "shard %s not listed again (%s): its files left by a killed run count as unowned", shard_id, exc
            )
    return found


def _stem(ref_key: str, ref_stem: str, key: str) -> str | None:
    """The stem of the sample `key` names when it is the clip `ref_key` or one of its windows (``key@first``)."""
    if not ref_stem:
        return None
    if key == ref_key:
        return ref_stem
    return ref_stem + key[len(ref_key) :] if key.startswith(ref_key + "@") else None


def bound(token: str, unowned: Iterable[str]) -> str:
    """An overwrite token that also covers the unowned files a preview listed (it removes them): another list, another
    token, so a token printed before a file appeared never removes it."""
    names = sorted(unowned)
    if not names:
        return token
    return hashlib.sha256("\0".join([token, *names]).encode()).hexdigest()[: len(token)]


def shown(out: outdir.Out, rels: Iterable[str], limit: int = 3) -> str:
    """A few of `rels` as paths, for one line."""
    rels = list(rels)
    more = f" and {len(rels) - limit} more" if len(rels) > limit else ""
    return ", ".join(outdir.shown(out, rel) for rel in rels[:limit]) + more
