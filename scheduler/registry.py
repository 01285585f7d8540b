"""The adapter registry: which adapter names the scheduler serves, and where each one lives.

One small interface fed by a directory (`lorafleet serve --adapters DIR`) or by the
Kubernetes API (LoraAdapter objects in phase Ready, see `kube.py`).
"""

from __future__ import annotations

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
    created: float = field(default_factory=time.time)
    problem: str | None = None


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
        """One adapter per subfolder holding an adapter_config.json, named by the folder.

        A subfolder (or its config file) that is a symlink resolving outside the directory is
        skipped with a warning: the directory is the boundary of what it publishes. Each adapter's
        files are checked as a runner checks them before reading the weights, short of the base model's shapes
        (peft_config.inspect_adapter without a base: the config is valid JSON and asks for no unsupported PEFT
        feature, the safetensors header is whole and lies within the file, the tensors are LoRA weights of the
        modules the config targets, at its rank); one that fails is published with that reason as its `problem`.
        """
        from lorafleet.common.peft_config import AdapterError, inspect_adapter, scrub_paths

        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"adapter directory {root} does not exist")
        real_root = root.resolve()
        entries = []
        for d in sorted(root.iterdir()):
            if not (d.is_dir() and (d / "adapter_config.json").is_file()):
                if d.is_dir() and not d.name.startswith("."):
                    log.warning("%s skipped: no adapter_config.json in it (not a PEFT adapter)", d)
                continue
            real = d.resolve()
            inside = real.parent == real_root or real_root in real.parents
            if not inside or real_root not in (d / "adapter_config.json").resolve().parents:
                log.warning("adapter %r skipped: it is a symlink to a place outside %s", d.name, root)
                continue
            try:
                inspect_adapter(d.name, real)
                problem = None
            except AdapterError as exc:
                problem = scrub_paths(exc.reason)
            except Exception as exc:  # a check that did not foresee this file: the adapter, not the server, fails
                problem = scrub_paths(f"cannot read its files ({type(exc).__name__}: {exc})")
            entries.append(AdapterEntry(name=d.name, source=str(real), problem=problem))
        return cls(entries)
