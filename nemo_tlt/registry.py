"""Named factories of one kind (rollout engines, policy backends): a new part is one file plus
one line.

A `Registry` holds the built-in names as import paths (``"package.module:factory"``, imported
only when used, so an optional package is never imported by a config check), takes more
names by `Registry.register` (a decorator, for a module the user imports before the run),
and takes any import path itself as a name: ``rollout.engine: my_pkg.engines:build`` builds
with ``my_pkg.engines.build`` without any registration. The config's allowed names are the
registry's (`Registry.check`).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from nemo_tlt.imports import is_import_path, load_object


class Registry:
    """Factories by name; ``kind`` and ``field`` name them in errors (e.g. "rollout engine",
    "rollout.engine")."""

    def __init__(self, kind: str, field: str, built_in: dict[str, str]) -> None:
        for name, path in built_in.items():
            if not is_import_path(path):
                raise ValueError(f"{kind} {name!r}: {path!r} is not an import path 'package.module:attr'")
        self.kind, self.field = kind, field
        self._entries: dict[str, str | Callable[..., Any]] = dict(built_in)

    def register(self, name: str, factory: Callable[..., Any] | None = None) -> Any:
        """Add ``name`` (``register(name, factory)``, or ``@register(name)`` on the factory); a
        name taken already, or one with the form of an import path, is a ValueError."""
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"{self.kind} name must be a non-empty string without ':', got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.field}: {self.kind} {name!r} is registered already")

        def add(fn: Callable[..., Any]) -> Callable[..., Any]:
            if not callable(fn):
                raise ValueError(f"{self.field}: the {self.kind} {name!r} must be callable, got {type(fn).__name__}")
            self._entries[name] = fn
            return fn

        return add if factory is None else add(factory)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def check(self, name: Any) -> None:
        """``name`` is a registered name or has the form of an import path (ValueError naming
        the field, the registered names and the import-path form otherwise)."""
        if name in self._entries or is_import_path(name):
            return
        raise ValueError(f"{self.field} must be one of {list(self._entries)} or an import path "
                         f"'package.module:factory', got {name!r}")

    def get(self, name: str) -> Callable[..., Any]:
        """The factory ``name`` stands for (built-in and import-path names imported now)."""
        self.check(name)
        entry = self._entries.get(name, name)
        factory = load_object(entry, self.field) if isinstance(entry, str) else entry
        if not callable(factory):
            raise ValueError(f"{self.field}={name!r}: {entry!r} is not callable")
        return factory
