"""Runner discovery: the set of runner endpoints, fed statically or from Kubernetes.

`RunnerDirectory.set_endpoints` is level-triggered: it receives the whole current set;
new ids join, missing ids leave (their in-flight requests are re-placed by the cluster).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass(frozen=True)
class RunnerEndpoint:
    id: str
    url: str  # base URL, e.g. http://10.0.0.7:8001


class RunnerDirectory:
    def __init__(self, endpoints: Iterable[RunnerEndpoint] = ()):
        self._endpoints: dict[str, RunnerEndpoint] = {}
        self._on_join: list[Callable[[RunnerEndpoint], None]] = []
        self._on_leave: list[Callable[[RunnerEndpoint], None]] = []
        self.set_endpoints(endpoints)

    def subscribe(self, on_join: Callable[[RunnerEndpoint], None], on_leave: Callable[[RunnerEndpoint], None]) -> None:
        self._on_join.append(on_join)
        self._on_leave.append(on_leave)
        for ep in self._endpoints.values():
            on_join(ep)

    def endpoints(self) -> list[RunnerEndpoint]:
        return [self._endpoints[k] for k in sorted(self._endpoints)]

    def set_endpoints(self, endpoints: Iterable[RunnerEndpoint]) -> None:
        new = {ep.id: ep for ep in endpoints}
        for rid, ep in list(self._endpoints.items()):
            if new.get(rid) != ep:
                del self._endpoints[rid]
                for fn in self._on_leave:
                    fn(ep)
        for rid, ep in new.items():
            if rid not in self._endpoints:
                self._endpoints[rid] = ep
                for fn in self._on_join:
                    fn(ep)
