"""A tar's samples made again from records of its listing, proven where they are used (DESIGN, invariant 10).

A plan that lists a plain tar in a store keeps what its listing found of each sample (`SampleRef.listed`: its
members' offsets) on this machine (`infra.sources.listing_cache`) and in its spool (`infra.cache.listing.
spool_records`), so that a later plan or the shard task makes the samples again without reading every header
(`Source.relisted`). A record is latentforge's own, read back: it is not trusted. It is checked for shape and range
when it is read (`tars.from_record`: a `BadRecord`), and each member is proven where its bytes are read: the header
at the recorded offset must name the member the record says, with its size (`tars.prove`; read in the same range
request as the member's bytes where they are read together). A record the tar does not bear out is never read as
that sample: the shard is listed again from its headers (once a task, `Relisting.now`), the sample read as that
listing finds it (or skipped ``not_in_shard`` when the tar holds no such sample), samples the records left out are
yielded after the others, and the machine's kept listing of the tar is dropped with one warning line.
"""

from __future__ import annotations

import logging
import random
import tarfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from infra.errors import InputError
from infra.sources import listing_cache
from infra.sources.base import Shard
from infra.sources.tars import PLAIN_TAR, BadRecord, Member, header_bytes, prove, stream_of

logger = logging.getLogger(__name__)

NOT_IN_SHARD = "not_in_shard"


class NotAsListed(Exception):
    """A record of a kept listing that the tar does not bear out, found by the plan's spot check: the listing is not
    used, the tar is listed again."""


class Recorded(Protocol):
    """A sample as a tar's listing found it (vbvr's sample directory, webdataset's key), made from a record or
    listed now."""

    #: Its members proven against the tar (a listing made now: True; made from a record: once `prove`d).
    proven: bool
    #: Made by a listing of the tar's headers (not from a record): what it lacks, the tar lacks.
    listed_now: bool

    @property
    def name(self) -> str:
        """What the listing groups its members by (a directory, a key)."""
        ...

    def checks(self) -> list[tuple[Member, Callable[[str], bool]]]:
        """Each member, with what accepts the name its header gives (the record's name for it)."""
        ...

    def adopt(self, found: Any) -> None:
        """Take the members a listing made now found for this sample (`found`: one of its own kind)."""
        ...


S = TypeVar("S", bound=Recorded)
#: A source's listing of an open tar: its samples in order, and the damage that stopped it (None: none).
Lister = Callable[[tarfile.TarFile], tuple[list[Any], str | None]]


def read_headers(tf_stream: Any, shard: Shard, member: Member) -> bytes:
    """The bytes of `member`'s headers: from the store's stream the tar reads (`tf_stream`), or from the local
    plain tar's file."""
    if tf_stream is not None:
        return header_bytes(tf_stream, member)
    with Path(shard.path).open("rb") as fh:
        return header_bytes(fh, member)


def unproven(sample: Recorded, headers: Callable[[Member], bytes]) -> str | None:
    """What the tar says against `sample`'s record (None: every member proven, and the sample marked so); `headers`
    gives a member's header bytes (read now, or taken from a read that fetched them with the member's bytes)."""
    if sample.proven:
        return None
    for member, named in sample.checks():
        if member.offset < 0:
            return "the record says no header offset"
        why = prove(headers(member), member, named)
        if why is not None:
            return why
    sample.proven = True
    return None


@dataclass
class Relisting(Generic[S]):
    """One task's records of one tar, and the tar's listing made now the first time one is not borne out."""

    shard: Shard
    lister: Lister
    opener: Callable[[Shard], tarfile.TarFile]
    found: dict[str, S] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    refuted: bool = False

    def now(self, why: str | None) -> dict[str, S]:
        """The tar's samples by name, listed from its headers (once a task); `why` (a record the tar refutes): one
        warning, and this machine's kept listing of the tar dropped."""
        with self._lock:
            if why is not None and not self.refuted:
                self.refuted = True
                logger.warning(
                    "shard %s: its listing's records are not what the tar holds (%s): listed again from the tar, "
                    "this machine's kept listing of it dropped",
                    self.shard.id,
                    why,
                )
                listing_cache.forget(self.shard)
            if self.found is None:
                with self.opener(self.shard) as tf:
                    samples, _ = self.lister(tf)
                self.found = {s.name: s for s in samples}
            return self.found

    def confirm(self, sample: S, lacking: str) -> None:
        """A sample made from a record that says it lacks a member its layout reads (`lacking`): a record cannot prove
        an absence, so the sample is made what the tar's listing (made now, once a task) finds under its name."""
        if sample.listed_now:
            return
        true = self.now(None).get(sample.name)
        if true is None or [m for m, _ in true.checks()] != [m for m, _ in sample.checks()]:
            self.now(f"{sample.name!r}: its record says it has no {lacking}")
        self.mend(sample, f"{sample.name!r}: its record says it has no {lacking}")

    def mend(self, sample: S, why: str) -> None:
        """Make `sample` what the tar holds under its name (listed now), or InputError ``not_in_shard``."""
        true = self.now(why).get(sample.name)
        if true is None:
            raise InputError(
                NOT_IN_SHARD,
                f"the listing of {self.shard.path} named {sample.name!r}, which the tar does not hold ({why}): "
                "not read; the next plan lists the tar again",
            )
        sample.adopt(true)
        sample.proven = sample.listed_now = True

    def check(self, sample: S, headers: Callable[[Member], bytes]) -> bool:
        """Prove `sample`'s record before its bytes are read (True); mend it from the tar's listing where it fails
        (False: its members are now the ones the tar holds under its name)."""
        why = unproven(sample, headers)
        if why is None:
            return True
        self.mend(sample, why)
        return False


def made(
    relisting: Relisting[S],
    records: Iterable[Any],
    from_record: Callable[[Any, int], S],
    tf: tarfile.TarFile,
    spot: bool = False,
) -> Iterator[S]:
    """The samples of `records` (checked for shape: `BadRecord`), in order, then those a listing made now found that
    the records left out; a malformed record ends the records there, the rest from the listing. `spot` (a plan's
    use of a kept listing): the tar's first header (read when it was opened) and one record picked at random proven
    before any is made (NotAsListed: the listing is not used)."""
    shard = relisting.shard
    if not shard.path.endswith(PLAIN_TAR):
        raise BadRecord(f"{shard.path}: records are kept of plain tars only")
    taken: set[str] = set()
    try:
        samples = (from_record(value, shard.size) for value in records)
        if spot:
            samples = iter(_spot_checked(list(samples), tf, relisting))
        for sample in samples:
            taken.add(sample.name)
            yield sample
    except ValueError as exc:  # a BadRecord, or a line that is not JSON (`infra.records.DamagedRecord`)
        if spot:
            raise NotAsListed(str(exc)) from exc
        relisting.now(str(exc))
    if relisting.found is not None:
        yield from (s for name, s in relisting.found.items() if name not in taken)


def _spot_checked(samples: list[S], tf: tarfile.TarFile, relisting: Relisting[S]) -> list[S]:
    """`samples`, once the tar's first header (tarfile read it when the tar was opened) agrees with the record of a
    member there, if one is, and one member record picked at random is proven (one small read); NotAsListed
    otherwise."""
    if not samples:
        return samples
    first = tf.next()  # read when the tar was opened: no request
    if first is None:
        raise NotAsListed("the tar has no member")
    at_first = [(s, m, named) for s in samples for m, named in s.checks() if m.offset == first.offset]
    for _, member, named in at_first:
        if not named(first.name) or (member.size, member.offset_data) != (first.size, first.offset_data):
            raise NotAsListed(f"its first member is {first.name!r}, not the one its record says")
    picked = random.choice(samples)
    checks = picked.checks()
    if checks:  # one member of it: its header alone, one small read
        member, named = random.choice(checks)
        why = prove(read_headers(stream_of(tf), relisting.shard, member), member, named)
        if why is not None:
            raise NotAsListed(f"{picked.name!r}: {why}")
    return samples
