"""What reconciliation reports: expected against produced per group, every missing sample with its reason, the
prompts truncated at ``max_length``, and the ledger rows outside the plan (`infra.audit.reconcile` fills it)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from infra import report_files as reports
from infra.sources.names import group_name, sample_name


@dataclass
class GroupCounts:
    """One group: samples expected, produced (every kind on disk), and produced per output kind."""

    expected: int = 0
    produced: int = 0
    kinds: dict[str, int] = field(default_factory=dict)

    @property
    def missing(self) -> int:
        return self.expected - self.produced


@dataclass(slots=True)  # one a sample listed: no __dict__ each
class SampleName:
    """Which sample: its id and group, and its shard and key in the source."""

    id: str
    group: str
    shard: str
    key: str


@dataclass(slots=True)  # one a sample listed: no __dict__ each
class MissingSample(SampleName):
    """An expected sample that is not produced; `status` is None when it has no ledger row."""

    status: str | None
    reason: str
    detail: str | None = None


@dataclass(slots=True)  # one a sample listed: no __dict__ each
class TruncatedPrompt(SampleName):
    """A done sample whose prompt had more tokens than the embedding keeps (`max_length`)."""

    tokens_total: int | None
    max_length: int


@dataclass(slots=True)  # one a sample listed: no __dict__ each
class GoneSample(SampleName):
    """A sample the ledger has (and OUT keeps) that is no longer in the source: removed upstream since."""

    status: str
    path: str | None


@dataclass
class ReconcileReport:
    """Expected against produced, per group, with every missing sample and every truncated prompt."""

    out: str
    source: str
    fingerprint: str
    format: str
    kinds: list[str]
    max_length: int
    groups: dict[str, GroupCounts] = field(default_factory=dict)
    missing: list[MissingSample] = field(default_factory=list)
    truncated: list[TruncatedPrompt] = field(default_factory=list)
    shard_problems: dict[str, str] = field(default_factory=dict)
    #: Ledger rows of planned shards for samples outside this selection (an earlier, wider run): not counted.
    unlisted: int = 0
    #: Ledger rows of samples the source no longer has (their shard, or the sample in it): kept, listed here.
    gone_from_source: list[GoneSample] = field(default_factory=list)
    #: Files of OUT the format's consumer would load that no ledger row owns (OUT-relative; `infra.gates.unowned`):
    #: a trainer would load more than is counted here.
    unowned: list[str] = field(default_factory=list)

    @property
    def expected(self) -> int:
        return sum(g.expected for g in self.groups.values())

    @property
    def produced(self) -> int:
        return sum(g.produced for g in self.groups.values())

    @property
    def shortfall(self) -> int:
        return self.expected - self.produced

    @property
    def ok(self) -> bool:
        return self.shortfall == 0

    def reasons(self) -> dict[str, int]:
        """Missing samples per reason, most frequent first."""
        return dict(Counter(m.reason for m in self.missing).most_common())

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data, with the totals."""
        data = asdict(self)
        for name, counts in self.groups.items():
            data["groups"][name]["missing"] = counts.missing
        totals = {"expected": self.expected, "produced": self.produced, "shortfall": self.shortfall}
        return {**data, **totals, "ok": self.ok, "reasons": self.reasons()}

    def table(self) -> list[dict[str, Any]]:
        """Rows for a table artifact: one per group, then the totals."""
        kinds: Counter[str] = Counter()
        for counts in self.groups.values():
            kinds.update(counts.kinds)
        named = [
            *((group_name(g), c) for g, c in sorted(self.groups.items())),
            ("total", GroupCounts(self.expected, self.produced, dict(kinds))),
        ]
        return [
            {"group": name, "expected": c.expected, "produced": c.produced, "missing": c.missing}
            | {f"produced {kind}": c.kinds.get(kind, 0) for kind in self.kinds}
            for name, c in named
        ]

    def markdown(self, limit: int | None = None) -> str:
        """Counts per group, reasons, missing samples (the first `limit`; None: all), truncated prompts."""
        return reports.render_markdown(self.headline(), self._intro(), self._sections(limit))

    def text(self, limit: int | None = 20) -> str:
        """The same for a terminal, listing the first `limit` missing samples and prompts (None: all)."""
        return reports.render_text(self.headline(), self._intro(), self._sections(limit))

    def headline(self) -> str:
        """One line: OK or the shortfall, produced of expected."""
        verdict = "OK" if self.ok else f"SHORTFALL {self.shortfall}"
        return f"reconcile: {verdict} ({self.produced} of {self.expected} expected samples produced)"

    def _intro(self) -> list[str]:
        lines = [f"cache `{self.out}`, fingerprint `{self.fingerprint[:16]}…`, source `{self.source}`"]
        lines.append(f"produced = done in the ledger and on disk at its size, for each of: {', '.join(self.kinds)}")
        if self.unlisted:
            lines.append(f"{self.unlisted} ledger row(s) outside this selection (not counted)")
        if self.gone_from_source:
            done = sum(g.status == "done" for g in self.gone_from_source)
            lines.append(
                f"{len(self.gone_from_source)} sample(s) of the ledger are gone from the source ({done} done: their "
                "files are kept, nothing is deleted)"
            )
        if self.unowned:
            lines.append(
                f"{len(self.unowned)} file(s) its consumer would load that no ledger row owns, not counted: a trainer "
                f"would load them too (first: {self.out}/{self.unowned[0]}); `latentforge verify` lists them"
            )
        return lines

    def missing_markdown(self, limit: int = 20, detail_chars: int = 80) -> str:
        """The missing samples for a narrow pane (the UI's resume dialog, an artifact): headline, counts by reason, then
        the first `limit` as sample name, reason and a shortened detail, three columns that fit without scrolling."""
        rows = [
            [sample_name(m.group, m.id), m.reason, _shortened(m.detail, detail_chars)] for m in self.missing[:limit]
        ]
        sections: list[reports.Section] = [
            ("Missing by reason", ["reason", "samples"], [list(item) for item in self.reasons().items()]),
            (f"Missing samples ({reports.shown(self.missing, limit)})", ["sample", "reason", "detail"], rows),
        ]
        intro = [f"cache `{self.out}`", "every missing sample with its reason: `latentforge reconcile OUT`"]
        return reports.render_markdown(self.headline(), intro, sections)

    def _sections(self, limit: int | None) -> list[reports.Section]:
        table, miss, cut = self.table(), self.missing, self.truncated
        return [
            ("Counts per group", list(table[0]), [list(row.values()) for row in table]),
            ("Missing by reason", ["reason", "samples"], [list(item) for item in self.reasons().items()]),
            (f"Missing samples ({reports.shown(miss, limit)})", *_grouped(MissingSample, miss[:limit])),
            (
                f"Prompts truncated at max_length ({reports.shown(cut, limit)})",
                *_grouped(TruncatedPrompt, cut[:limit]),
            ),
            ("Shard problems", ["shard", "problem"], [list(item) for item in sorted(self.shard_problems.items())]),
            (
                f"Gone from the source, kept in the cache ({reports.shown(self.gone_from_source, limit)})",
                *_grouped(GoneSample, self.gone_from_source[:limit]),
            ),
            (
                f"Files its consumer would load that no ledger row owns ({reports.shown(self.unowned, limit)})",
                ["file"],
                [[f"{self.out}/{rel}"] for rel in self.unowned[:limit]],
            ),
        ]


def _grouped(kind: type, items: list[Any]) -> tuple[list[str], list[list[Any]]]:
    """`reports.dataclass_rows` with the group column printed as every report prints a group (`group_name`)."""
    header, rows = reports.dataclass_rows(kind, items)
    at = header.index("group")
    return header, [[*row[:at], group_name(row[at]), *row[at + 1 :]] for row in rows]


def _shortened(text: str | None, chars: int) -> str:
    """One line of at most `chars` characters (an ellipsis where cut)."""
    flat = " ".join(str(text or "").split())
    return flat if len(flat) <= chars else flat[: chars - 1] + "…"
