"""Pages of the paged KV cache: a free list, per-request page tables, and the prefix cache.

A request's page table is `seq.pages` (a list of page ids). With the prefix cache on, every *full* page of
a request whose tokens are known is registered under a key chained over (the request's key root, the
previous page's key, the page's token ids); the root names the adapter by its content (or the base model)
and the request's cache salt, so pages are never shared across adapters, adapter versions or salts.

- A page may sit in several page tables (`refs`); only full pages are shared, and a request only ever
  writes at or after its first unshared position, so a shared page is never written (no copy is needed).
- A page nobody holds any more stays cached, least recently used first in line to be reused: `grow`
  takes never-cached pages first, then evicts cached ones, so cached pages go before any running request
  is preempted (they count as free: `free_pages`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def key_root(identity: str, salt: str | None) -> bytes:
    """The start of a request's key chain: the model or adapter identity and the cache salt."""
    return hashlib.blake2b(f"{identity}\0{salt or ''}".encode(), digest_size=16).digest()


def chain_keys(root: bytes, tokens: list[int], page_size: int, start: int = 0, keys: list[bytes] | None = None) -> list[bytes]:
    """The keys of the full pages of `tokens` (continuing `keys`, the keys of pages before `start`)."""
    keys = list(keys or [])
    parent = keys[-1] if keys else root
    arr = np.asarray(tokens, dtype=np.int64)
    for p in range(start, len(tokens) // page_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(arr[p * page_size:(p + 1) * page_size].tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


class BlockManager:
    """Hands out fixed-size KV pages; with `caching`, keeps full pages for reuse by later requests."""

    def __init__(self, num_pages: int, page_size: int, caching: bool = False):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need at least one page of at least one token (got {num_pages} x {page_size})")
        self.num_pages = num_pages
        self.page_size = page_size
        self.caching = caching
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # never-cached pages; pop() yields low ids first
        self.refs = [0] * num_pages  # page tables holding each page
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, oldest first
        self.stats = {"queries": 0, "hits": 0, "evictions": 0}  # prompt tokens looked up/found (cache on); pages reused

    @property
    def free_pages(self) -> int:
        """Pages a request can get: never-cached ones and cached ones nobody holds."""
        return len(self._free) + len(self._lru)

    @property
    def free_tokens(self) -> int:
        return self.free_pages * self.page_size

    @property
    def total_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def cached_pages(self) -> int:
        return len(self._key_of)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def extra_pages(self, pages: list[int], num_tokens: int) -> int:
        """Pages a page table must gain to hold `num_tokens` tokens."""
        return max(0, self.pages_for(num_tokens) - len(pages))

    def _take(self) -> int:
        if self._free:
            p = self._free.pop()
        else:  # the least recently used cached page: forget its content
            p, _ = self._lru.popitem(last=False)
            del self._page_of[self._key_of.pop(p)]
            self.stats["evictions"] += 1
        self.refs[p] = 1
        return p

    def grow(self, pages: list[int], num_tokens: int) -> bool:
        """Extend `pages` in place to hold `num_tokens`; False (and no change) if pages run out."""
        need = self.extra_pages(pages, num_tokens)
        if need > self.free_pages:
            return False
        for _ in range(need):
            pages.append(self._take())
        return True

    def release(self, pages: list[int]) -> None:
        """Let go of every page of a page table at once and empty it: a cached page nobody else holds stays
        cached (least recently used last), the others are free."""
        for p in reversed(pages):
            self.refs[p] -= 1
            if self.refs[p]:
                continue
            if p in self._key_of:
                self._lru[p] = None
            else:
                self._free.append(p)
        pages.clear()

    # -- the prefix cache ---------------------------------------------------------------------------------
    def match(self, keys: list[bytes]) -> list[int]:
        """The cached pages of the longest run of `keys` from the first, now also held by the caller."""
        out = []
        for k in keys:
            p = self._page_of.get(k)
            if p is None:
                break
            if self.refs[p] == 0:
                self._lru.pop(p)
            self.refs[p] += 1
            out.append(p)
        return out

    def register(self, pages: list[int], keys: list[bytes], start: int) -> None:
        """Pages `start:len(keys)` of a page table hold the content `keys` names: cache them (a key already
        cached elsewhere keeps its page; this copy stays private)."""
        if not self.caching:
            return
        for i in range(start, len(keys)):
            p, k = pages[i], keys[i]
            if k in self._page_of or p in self._key_of:
                continue
            self._page_of[k] = p
            self._key_of[p] = k

    def clear_cache(self) -> int:
        """Forget every cached page nobody holds; the number forgotten."""
        n = len(self._lru)
        while self._lru:
            p, _ = self._lru.popitem(last=False)
            del self._page_of[self._key_of.pop(p)]
            self._free.append(p)
        return n
