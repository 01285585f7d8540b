"""Turn an adapter's source (a URI, or an absolute path under the source roots) into a local
directory the engine can read, under the source policy (`common/source_policy.py`)."""

from __future__ import annotations

import logging
from pathlib import Path

from lorafleet import env
from lorafleet.common.peft_config import AdapterError, scrub_paths

log = logging.getLogger(__name__)


def local_adapter_dir(name: str, source: str, sha256: str | None = None) -> Path:
    """Blocking: fetch when remote (cached), confine when local, verify sha256 when given.

    Raises AdapterError naming the adapter; its reason never shows a server path.
    """
    from lorafleet.common.sources import SourceError, fetch_adapter

    try:
        return Path(fetch_adapter(source, cache_dir=env.cache_dir() / "adapters", sha256=sha256, label="source"))
    except SourceError as exc:
        log.warning("adapter %r (%s): %s", name, source, exc)
        raise AdapterError(name, scrub_paths(str(exc))) from None
    except OSError as exc:
        log.warning("adapter %r (%s): %s", name, source, exc)
        raise AdapterError(name, f"source: cannot be read ({exc.strerror or type(exc).__name__})") from None
