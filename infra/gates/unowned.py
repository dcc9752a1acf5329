"""Files a trainer would load from OUT that the ledger does not know (DESIGN, invariant 10).

A format declares its consumer's own glob (`infra.formats.base.Format.consumer_glob`: musubi-tuner's
``*_wan.safetensors``, DiffSynth-Studio's every ``.pth``, ...). `Scan` lists the files of OUT that glob matches, once,
and every ledger row read takes its own files off the list: what is left is unowned, and so is every link among the
names the consumer reaches (it would follow one). A trainer pointed at OUT would load those too, so verify, reconcile
and inspect name them, and a build stops at them like at any other conflict: a person keeps them (``reuse``), has
them removed (an approved ``overwrite``), writes elsewhere (``new_dir``) or stops.

One kind of unowned file is not a stop: one a run wrote for a sample of a shard it did not finish (it died between
the file and its row, or before sealing the shard's ledger). Such a file is at the path of a sample the plan lists in
a shard with no sealed ledger, or with a journal still open; the resume adopts it (this spec's, for that sample) or
records why not (``output_exists``). `leftovers` finds those among the unowned files, listing those shards again: only
when a file is unowned at all, and only the shards a run left unfinished.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from infra import outdir
from infra.cache.ledger import LEDGER_DIR, LedgerRow
from infra.errors import LatentforgeError
from infra.formats import Format, get_format
from infra.job import Job
from infra.plan import ShardPlan
from infra.sources import open_source

logger = logging.getLogger(__name__)

_JOURNAL = ".journal"


@dataclass
class Scan:
    """The files of OUT its consumer loads, less those the ledger rows read so far own; the links it would follow."""

    out: outdir.Out
    fmt: Format
    left: set[str] = field(default_factory=set)
    links: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, out: outdir.Out, fmt: Format) -> Scan:
        """One listing of what the consumer loads from OUT."""
        found = fmt.consumer_glob.files(out)
        return cls(out, fmt, set(found.files), list(found.links))

    def owned(self, rows: Iterable[LedgerRow]) -> None:
        """Take the files `rows` name off the list."""
        for row in rows:
            for file in row.output_files():
                self.left.discard(file.path)

    def files(self) -> list[str]:
        """The unowned files (links aside), OUT-relative, sorted."""
        return sorted(self.left)

    def unowned(self) -> list[str]:
        """Every unowned file and link, OUT-relative, sorted."""
        return sorted(self.left | set(self.links))


def finished_shards(out: outdir.Out) -> set[str]:
    """The shards whose ledger is sealed with no journal beside it (one listing of ``OUT/ledger``)."""
    names = {entry.name for entry in outdir.entries(out, LEDGER_DIR)}
    sealed = {n.removesuffix(".jsonl") for n in names if n.endswith(".jsonl") and not n.endswith(f"{_JOURNAL}.jsonl")}
    open_ = {n.removesuffix(".jsonl").removesuffix(_JOURNAL) for n in names if _JOURNAL in n}
    return sealed - open_


def leftovers(job: Job, shards: list[ShardPlan], finished: set[str], unowned: Iterable[str]) -> set[str]:
    """The `unowned` files at the paths of samples of the plan's `shards` that a run left unfinished (not in
    `finished`): each such shard listed again to name its samples' files. A shard that cannot be listed explains
    none of them."""
    left = set(unowned)
    open_shards = [shard for shard in shards if shard.id not in finished]
    if not left or not open_shards:
        return set()
    fmt, found = get_format(job.spec.format), set()
    source = open_source(job.source, job.spec, job.limits)
    for shard in open_shards:
        try:
            with contextlib.closing(source.samples(shard.shard)) as refs:
                for ref in refs:
                    found |= {rel for rel in left - found if ref.stem and _of_sample(fmt, job, ref.stem, rel)}
        except (LatentforgeError, OSError, ValueError) as exc:  # damaged or gone: its files stay unowned
            logger.warning(
                "shard %s not listed again (%s): files a killed run left there count as unowned", shard.id, exc
            )
        if found == left:
            break
    return found


def _of_sample(fmt: Format, job: Job, stem: str, rel: str) -> bool:
    """Whether `rel` is a file of the sample `stem`, or of one of its windows (``stem@first``)."""
    stems = [stem, *(f"{stem}@{first}" for first in set(re.findall(r"@(\d+)", rel)))]
    return any(fmt.sample_file(name, job.kinds, rel) for name in stems)


def bound(token: str, unowned: Iterable[str]) -> str:
    """An overwrite token that also covers the unowned files a preview listed (it removes them): another list, another
    token, so a token printed before a file appeared never removes it."""
    names = sorted(unowned)
    if not names:
        return token
    return hashlib.sha256("\0".join([token, *names]).encode()).hexdigest()[: len(token)]
