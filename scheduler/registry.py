"""The adapter registry: which adapter names the scheduler serves, and where each one lives.

One small interface fed by a directory (`lorafleet serve --adapters DIR`, rescanned by `DirectoryFeed`) or by
the Kubernetes API (LoraAdapter objects in phase Ready, see `kube.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterEntry:
    """A published adapter. `source` is what runners load: a local path or a URI. `problem`: why it cannot be
    served, as found when it was published (a directory's scan checks each adapter's files); None: nothing known
    against it. The scheduler lists an adapter with a problem as unavailable from the start (server.py)."""

    name: str
    source: str
    sha256: str | None = None
    rank: int | None = None
    base_model: str | None = None
    created: float = field(default_factory=time.time, compare=False)
    problem: str | None = None
    version: str | None = None  # a directory adapter's files' fingerprint: runners read a new version again


class AdapterRegistry:
    """name -> AdapterEntry. Level-triggered feeds call `replace_all`; listeners hear changes."""

    def __init__(self, entries: Iterable[AdapterEntry] = ()):
        self._entries: dict[str, AdapterEntry] = {}
        self._listeners: list[Callable[[str, AdapterEntry | None], None]] = []
        self.replace_all(entries)

    def get(self, name: str) -> AdapterEntry | None:
        return self._entries.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[AdapterEntry]:
        return [self._entries[n] for n in self.names()]

    def subscribe(self, fn: Callable[[str, AdapterEntry | None], None]) -> None:
        """`fn(name, entry)` on every change; entry None means the adapter was removed."""
        self._listeners.append(fn)

    def put(self, entry: AdapterEntry) -> None:
        if self._entries.get(entry.name) == entry:
            return
        self._entries[entry.name] = entry
        for fn in self._listeners:
            fn(entry.name, entry)

    def remove(self, name: str) -> None:
        if self._entries.pop(name, None) is not None:
            for fn in self._listeners:
                fn(name, None)

    def replace_all(self, entries: Iterable[AdapterEntry]) -> None:
        new = {e.name: e for e in entries}
        for name in [n for n in self._entries if n not in new]:
            self.remove(name)
        for e in new.values():
            self.put(e)

    @classmethod
    def from_directory(cls, path: str | Path) -> "AdapterRegistry":
        """The adapters of a directory (`scan_directory`)."""
        return cls(scan_directory(path))


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def files_version(folder: Path) -> str:
    """A fingerprint of an adapter folder's files (size and modification time of each): it changes when they do."""
    parts = []
    for name in ADAPTER_FILES:
        try:
            st = (folder / name).stat()
            parts.append(f"{st.st_size}.{st.st_mtime_ns}")
        except OSError:
            parts.append("-")
    return "/".join(parts)


def scan_directory(path: str | Path, known: dict[str, AdapterEntry] | None = None,
                   skip: frozenset[str] = frozenset(), noted: set[str] | None = None) -> list[AdapterEntry]:
    """One adapter per subfolder holding an adapter_config.json, named by the folder; names in `skip` are left out.

    A subfolder (or its config file) that is a symlink resolving outside the directory is
    skipped with a warning: the directory is the boundary of what it publishes. Each adapter's
    files are checked as a runner checks them before reading the weights, short of the base model's shapes
    (peft_config.inspect_adapter without a base: the config is valid JSON and asks for no unsupported PEFT
    feature, the safetensors header is whole and lies within the file, the tensors are LoRA weights of the
    modules the config targets, at its rank); one that fails is published with that reason as its `problem`.
    Each entry carries its files' `version` (files_version); an adapter of `known` whose folder and version are
    unchanged is taken as it is, unchecked again. `noted`: folders already warned about (a rescan warns once).
    """
    from lorafleet.common.peft_config import AdapterError, inspect_adapter, scrub_paths

    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"adapter directory {root} does not exist")
    known = known or {}
    noted = set() if noted is None else noted

    def warn(name: str, msg: str, *args) -> None:
        if name not in noted:
            noted.add(name)
            log.warning(msg, *args)

    real_root = root.resolve()
    entries = []
    for d in sorted(root.iterdir()):
        if d.name in skip:
            warn(d.name, "adapter folder %r skipped: it has the base model's name (requests for it reach the base "
                 "model)", d.name)
            continue
        if not (d.is_dir() and (d / "adapter_config.json").is_file()):
            if d.is_dir() and not d.name.startswith("."):
                warn(d.name, "%s skipped: no adapter_config.json in it (not a PEFT adapter)", d)
            continue
        real = d.resolve()
        inside = real.parent == real_root or real_root in real.parents
        if not inside or real_root not in (d / "adapter_config.json").resolve().parents:
            warn(d.name, "adapter %r skipped: it is a symlink to a place outside %s", d.name, root)
            continue
        noted.discard(d.name)  # (a folder that becomes an adapter is warned about again if it stops being one)
        version = files_version(real)
        old = known.get(d.name)
        if old is not None and old.source == str(real) and old.version == version:
            entries.append(old)
            continue
        try:
            inspect_adapter(d.name, real)
            problem = None
        except AdapterError as exc:
            problem = scrub_paths(exc.reason)
        except Exception as exc:  # a check that did not foresee this file: the adapter, not the server, fails
            problem = scrub_paths(f"cannot read its files ({type(exc).__name__}: {exc})")
        entries.append(AdapterEntry(name=d.name, source=str(real), problem=problem, version=version))
    return entries


class DirectoryFeed:
    """Keeps a registry equal to an adapter directory: every `interval` seconds the directory is scanned again
    (off the event loop; only new or changed folders are checked), so adapters added, changed or removed there are
    served, served anew (runners read the new files: the entry's version changed) or refused, without a restart.
    `skip`: folder names never published (the base model's name)."""

    def __init__(self, registry: AdapterRegistry, root: str | Path, interval: float,
                 skip: frozenset[str] = frozenset()):
        self.registry, self.root, self.interval, self.skip = registry, Path(root), interval, skip
        self.noted: set[str] = set()  # folders warned about: not again at every rescan

    def scan(self, known: dict[str, AdapterEntry] | None = None) -> list[AdapterEntry]:
        """The directory's adapters now (reads files: call it off the event loop, with `known` the registry's
        entries taken on it; default: taken here)."""
        if known is None:
            known = {e.name: e for e in self.registry.entries()}
        return scan_directory(self.root, known, self.skip, self.noted)

    def apply(self, entries: list[AdapterEntry]) -> tuple[list[str], list[str], list[str]]:
        """Publish a scan (on the registry's own thread: its listeners run here); (added, changed, removed)."""
        before = {e.name: e for e in self.registry.entries()}
        after = {e.name: e for e in entries}
        self.registry.replace_all(entries)
        added = sorted(n for n in after if n not in before)
        changed = sorted(n for n in after if n in before and after[n] != before[n])
        removed = sorted(n for n in before if n not in after)
        return added, changed, removed

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval)
            known = {e.name: e for e in self.registry.entries()}  # (on the loop, where the registry changes)
            try:
                added, changed, removed = self.apply(await loop.run_in_executor(None, self.scan, known))
            except FileNotFoundError:
                log.warning("adapter directory %s is gone; keeping the adapters published so far", self.root)
                continue
            except Exception as exc:  # an unreadable folder, anything unforeseen: this rescan fails, not the next
                log.warning("cannot rescan the adapter directory %s: %s: %s", self.root, type(exc).__name__, exc)
                continue
            for what, names in (("added", added), ("changed (runners read the new files)", changed),
                                ("removed", removed)):
                if names:
                    log.info("adapters %s: %s", what, ", ".join(names))
