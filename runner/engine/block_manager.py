"""Page allocator of the paged KV cache: a free list of pages and per-request page tables."""

from __future__ import annotations


class BlockManager:
    """Hands out fixed-size KV pages. A request's page table is `seq.pages` (a list of ids)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need at least one page of at least one token (got {num_pages} x {page_size})")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() yields low ids first

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def free_tokens(self) -> int:
        return len(self._free) * self.page_size

    @property
    def total_tokens(self) -> int:
        return self.num_pages * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def extra_pages(self, pages: list[int], num_tokens: int) -> int:
        """Pages a page table must gain to hold `num_tokens` tokens."""
        return max(0, self.pages_for(num_tokens) - len(pages))

    def grow(self, pages: list[int], num_tokens: int) -> bool:
        """Extend `pages` in place to hold `num_tokens`; False (and no change) if pages run out."""
        need = self.extra_pages(pages, num_tokens)
        if need > len(self._free):
            return False
        for _ in range(need):
            pages.append(self._free.pop())
        return True

    def release(self, pages: list[int]) -> None:
        """Return every page of a page table at once and empty it."""
        self._free.extend(reversed(pages))
        pages.clear()
