"""The host's book of the paged KV cache: free pages, reservations, reference counts and shared prompt prefixes."""

from __future__ import annotations

from collections.abc import Sequence

from lm_models.paged_cache import NULL_PAGE


class PoolFullError(Exception):
    """No page is free: a sequence grew past what was reserved for it (a bug in the caller's reservation)."""


class PagePool:
    """Pages 1..num_pages-1 of a paged cache (page 0 is the null page); each live page has a reference count.

    A request reserves the pages it may need when it is admitted, so a running sequence never waits for a page.
    A full page of prompt tokens is registered under (the page before it, its tokens): a later prompt that starts
    with the same tokens shares those pages, read-only, and adds a reference; a page goes back to the free list
    when its last reference is released.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self.refs = [0] * num_pages
        self.reserved = 0
        self._prefixes: dict[tuple[int, tuple[int, ...]], int] = {}
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}

    @property
    def capacity(self) -> int:
        """Pages that sequences can use at all (every page but the null page)."""
        return self.num_pages - 1

    @property
    def free(self) -> int:
        """Pages on the free list."""
        return len(self._free)

    @property
    def in_use(self) -> int:
        """Pages held by at least one sequence."""
        return self.capacity - self.free

    def stats(self) -> dict[str, int]:
        """The pool's pages: capacity, free, in use and reserved."""
        return {"pages_capacity": self.capacity, "pages_free": self.free, "pages_in_use": self.in_use,
                "pages_reserved": self.reserved}  # fmt: skip

    def pages_for(self, tokens: int) -> int:
        """Pages that hold `tokens` positions."""
        return -(-tokens // self.page_size)

    def try_reserve(self, pages: int) -> bool:
        """Set aside `pages` free pages for a sequence's growth; False (nothing reserved) when too few are left."""
        if pages > self.free - self.reserved:
            return False
        self.reserved += pages
        return True

    def unreserve(self, pages: int) -> None:
        """Give back reserved pages that a sequence did not use."""
        self.reserved -= pages

    def allocate(self) -> int:
        """A free page, taken from the caller's reservation, with one reference."""
        if not self._free or self.reserved < 1:
            raise PoolFullError(f"no reserved page left (free {self.free}, reserved {self.reserved})")
        self.reserved -= 1
        page = self._free.pop()
        self.refs[page] = 1
        return page

    def share_prefix(self, tokens: Sequence[int]) -> list[int]:
        """The registered pages that hold the longest run of whole pages at the start of `tokens`, each with one
        more reference."""
        pages: list[int] = []
        previous = NULL_PAGE
        for start in range(0, len(tokens) - self.page_size + 1, self.page_size):
            page = self._prefixes.get((previous, tuple(tokens[start : start + self.page_size])))
            if page is None:
                break
            self.refs[page] += 1
            pages.append(page)
            previous = page
        return pages

    def register(self, page: int, previous: int, tokens: Sequence[int]) -> None:
        """Offer a page whose keys/values now hold `tokens` (a whole page), after page `previous` (NULL_PAGE first),
        for later prompts to share."""
        key = (previous, tuple(tokens))
        if len(key[1]) == self.page_size and key not in self._prefixes and page not in self._key_of:
            self._prefixes[key] = page
            self._key_of[page] = key

    def register_prompt(self, pages: Sequence[int], prompt: Sequence[int], registered: int, computed: int) -> int:
        """Register a sequence's whole prompt pages computed since the first `registered`; how many are now."""
        size = self.page_size
        while (registered + 1) * size <= min(computed, len(prompt)):
            previous = pages[registered - 1] if registered > 0 else NULL_PAGE
            self.register(pages[registered], previous, prompt[registered * size : (registered + 1) * size])
            registered += 1
        return registered

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; pages left with none are free again (and no longer shared)."""
        for page in pages:
            if self.refs[page] < 1:
                raise ValueError(f"page {page} released more often than it was taken")
            self.refs[page] -= 1
            if self.refs[page] == 0:
                key = self._key_of.pop(page, None)
                if key is not None:
                    del self._prefixes[key]
                self._free.append(page)
