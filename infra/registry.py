"""One registry for everything chosen by name: families, formats, sources, remotes, runners.

A registry maps a name to an implementation; an unknown name is a `ConfigError` of one shape for every kind
("unknown family 'x'; known families: a, b"). A registry with an entry-point group also finds
implementations installed by other packages (plugins), loaded on first lookup of a name it does not hold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Generic, TypeVar

from infra.errors import ConfigError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Registry(Generic[T]):
    """Name → implementation, for one kind of thing (``kind`` names it in errors: "family", "format", ...)."""

    def __init__(
        self,
        kind: str,
        *,
        plural: str | None = None,
        entry_points: str | None = None,
        error: type[ConfigError] = ConfigError,
    ) -> None:
        self.kind = kind
        self.error = error
        self.plural = plural or f"{kind}s"
        self.entry_points = entry_points
        self._items: dict[str, T] = {}
        self._broken: set[str] = set()  # entry points that failed to load: named once, not retried

    def add(self, name: str, item: T) -> T:
        """Register `item` under `name`; a second, different item under one name is an error."""
        if name in self._items and self._items[name] is not item:
            raise self.error(f"two {self.plural} are registered as {name!r}")
        self._items[name] = item
        return item

    def replace(self, name: str, item: T) -> T:
        """Put `item` under `name` in place of what is there (a plugin renamed to the name it is found by)."""
        self._items[name] = item
        return item

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of `add`."""
        return lambda item: self.add(name, item)

    def get(self, name: str) -> T:
        """The implementation registered under `name` (plugins included), or a ConfigError naming the known ones."""
        if name not in self._items:
            self.load_plugins()
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(self.names()) or "none"
            raise self.error(f"unknown {self.kind} {name!r}; known {self.plural}: {known}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def values(self) -> list[T]:
        self.load_plugins()
        return [self._items[name] for name in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def load_plugins(self) -> None:
        """Register what installed packages declare in this registry's entry-point group and is not registered yet
        (the group is listed again on each call: a package installed while the process runs is found too)."""
        if self.entry_points is None:
            return
        for entry in metadata.entry_points(group=self.entry_points):
            if entry.name in self._items or entry.name in self._broken:
                continue
            try:
                loaded = entry.load()
            except Exception as exc:  # noqa: BLE001 - a broken plugin is named, the others still load
                logger.error(
                    "%s plugin %r (%s) does not load: %s: %s",
                    self.kind,
                    entry.name,
                    entry.value,
                    type(exc).__name__,
                    exc,
                )
                self._broken.add(entry.name)
                continue
            self.add(entry.name, loaded() if isinstance(loaded, type) else loaded)
