"""Turn an adapter's source (local path or URI) into a local directory the engine can read."""

from __future__ import annotations

from pathlib import Path

from lorafleet import env
from lorafleet.common.peft_config import AdapterError


def local_adapter_dir(name: str, source: str, sha256: str | None = None) -> Path:
    """Blocking: fetch when remote (cached), verify sha256 when given; AdapterError on failure."""
    if source.startswith("file://"):
        source = source[len("file://"):]
    if "://" not in source:
        path = Path(source)
        if sha256:
            from lorafleet.common.sources import verify_sha256

            verify_sha256(name, path, sha256)
        return path
    try:
        from lorafleet.common.sources import fetch_adapter
    except ImportError:  # pragma: no cover - sources ships with lorafleet
        raise AdapterError(name, f"cannot fetch {source}: remote sources are not available") from None
    try:
        return Path(fetch_adapter(source, cache_dir=env.cache_dir() / "adapters", sha256=sha256, name=name))
    except AdapterError:
        raise
    except Exception as exc:
        raise AdapterError(name, f"cannot fetch {source}: {exc}") from None
