"""The operator's own settings (command-line flags of `lorafleet operator`)."""

from __future__ import annotations

from dataclasses import dataclass

from lorafleet import __version__


@dataclass(frozen=True)
class OperatorConfig:
    # Images used when a ServingPool does not name its own.
    scheduler_image: str = f"lorafleet/operator:{__version__}"
    runner_image: str = f"lorafleet/runner:{__version__}"
    # How the operator reaches a pool's scheduler; {name} is the pool, {namespace} its namespace.
    scheduler_url: str = "http://{name}-scheduler.{namespace}.svc:8000"
    # Seconds between two looks at a pool (status, autoscaler) and between re-applies of its children.
    sync_interval_s: float = 10.0
    resync_interval_s: float = 60.0
    # Seconds between two retries of a Pending or retryably Failed adapter.
    adapter_retry_s: float = 30.0
    # How long deleting an adapter waits for the scheduler to stop serving it.
    adapter_release_timeout_s: float = 60.0
    # Timeouts of the operator's own HTTP calls (scheduler admin API, adapter sources).
    http_timeout_s: float = 10.0
    fetch_timeout_s: float = 60.0
    # Watch the CRD and namespace lists (needs list/watch on them); off for fixed setups.
    scanning: bool = True
    # The key every pool's tokens are derived from (credentials.py); None: a random key per process.
    credentials_key_file: str | None = None
