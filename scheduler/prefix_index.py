"""Which runner recently computed which leading KV pages: prefix-aware placement's approximate memory.

The runners key their prefix cache by a hash chain over full KV pages, rooted in the adapter's identity
and the request's cache salt (runner/engine/block_manager.py). The scheduler cannot see those caches, so
it keeps a guess of its own, per runner: the keys of the leading full pages of the requests it placed
there (recorded at placement, and again with the generated tokens when a request ends there, since the
next turn of a chat resends them), least recently used first out, at most as many pages as the runner's
KV cache holds and at most `MAX_RUNNER_PAGES`.

Keys chain like the runner's (blake2b of the parent key and the page's int64 token ids, with the runner's
page size), rooted in what the scheduler knows of the adapter (name, source, sha256; "base" for the base
model) and the salt; only the first `MAX_PAGES` pages of a request are hashed. A wrong guess (pages the
runner has since evicted, an adapter rewritten under the same source) costs a prefill, never a wrong
token: the runner decides what it really holds. A runner that fails, leaves or restarts is forgotten.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Hashable, Sequence

MAX_PAGES = 256  # leading pages hashed per request (4,096 tokens of 16-token pages)
MAX_RUNNER_PAGES = 1 << 15  # index entries per runner at most (~4 MB)
DIGEST = 8  # bytes per key: a collision only misleads placement


def adapter_key(adapter) -> str:
    """What the index roots an adapter's pages in (None: the base model)."""
    if adapter is None:
        return "base"
    return f"lora\0{adapter.name}\0{adapter.source}\0{adapter.sha256 or ''}"


def root(adapter, salt: str | None) -> bytes:
    data = f"{adapter_key(adapter)}\0{salt or ''}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=DIGEST).digest()


def chain(parent: bytes, ids: Sequence[int], page_size: int, start: int, stop: int, keys: list[bytes]) -> None:
    """Append to `keys` the keys of pages start..stop-1 of `ids` (`parent`: the key of page start-1, or the root)."""
    for p in range(start, stop):
        h = hashlib.blake2b(parent, digest_size=DIGEST)
        h.update(array("q", ids[p * page_size:(p + 1) * page_size]).tobytes())
        parent = h.digest()
        keys.append(parent)


def request_keys(req, page_size: int) -> list[bytes]:
    """The keys of a request's leading full pages whose K/V a runner computes (every token but the last, prompt
    and generated), at most MAX_PAGES; kept on the request and extended as its tokens grow."""
    if req.prefix_page_size != page_size:
        req.prefix_page_size, req.prefix_keys = page_size, []
    keys = req.prefix_keys
    want = min((req.num_tokens - 1) // page_size, MAX_PAGES)
    if want > len(keys):
        ids = req.prompt_ids if want * page_size <= len(req.prompt_ids) else req.prompt_ids + req.generated
        chain(keys[-1] if keys else root(req.adapter, req.cache_salt), ids, page_size, len(keys), want, keys)
    return keys


class PrefixIndex:
    """Per runner, an LRU set of page keys (any hashable: the simulator uses its own)."""

    def __init__(self, max_runner_pages: int = MAX_RUNNER_PAGES):
        self.max_runner_pages = max_runner_pages
        self.pages: dict[str, OrderedDict[Hashable, None]] = {}

    def record(self, runner: str, keys: Sequence[Hashable], capacity: int | None = None) -> None:
        """The runner now holds these pages, the leading ones most recently used (a runner frees a page table
        from its end, so its LRU keeps a prefix's first pages longest); at most `capacity` pages are kept."""
        if not keys:
            return
        od = self.pages.setdefault(runner, OrderedDict())
        for k in reversed(keys):
            od[k] = None
            od.move_to_end(k)
        cap = min(capacity or self.max_runner_pages, self.max_runner_pages)
        while len(od) > cap:
            od.popitem(last=False)

    def match(self, runner: str, keys: Sequence[Hashable]) -> int:
        """How many leading pages of `keys` the runner likely holds."""
        od = self.pages.get(runner)
        if not od:
            return 0
        n = 0
        for k in keys:
            if k not in od:
                break
            n += 1
        return n

    def forget(self, runner: str) -> None:
        self.pages.pop(runner, None)
