"""An LRU cache from segment text (and its message-text spans) to token ids."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable


class SegmentCache:
    """Small LRU mapping from a rendered segment's text to its token ids.

    A long history is then tokenized once, not on every turn: only segments whose text is new
    (the new user message, the previous answer as re-rendered without its think block) go
    through `encode`. Keyed by text (and spans, when given), so use one cache per tokenizer.
    """

    def __init__(self, maxsize: int = 1024) -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be at least 1")
        self.maxsize = maxsize
        self.hits = 0
        self.misses = 0
        self._data: OrderedDict[Hashable, tuple[int, ...]] = OrderedDict()

    def encode(
        self, encode: Callable[..., list[int]], text: str, spans: tuple | None = None
    ) -> tuple[int, ...]:
        """The ids of `text`, from the cache or from `encode` (then stored).

        With `spans` (where message text sits in `text`), `encode(text, spans)` is called.
        """
        key = text if spans is None else (text, spans)
        ids = self._lookup(key)
        if ids is None:
            ids = self._encode(encode, text, spans)
            self._store(key, ids)
        return ids

    @staticmethod
    def _encode(encode: Callable[..., list[int]], text: str, spans: tuple | None):
        if not text:
            return ()
        return tuple(encode(text) if spans is None else encode(text, spans))

    def _lookup(self, key: Hashable) -> tuple[int, ...] | None:
        ids = self._data.get(key)
        if ids is None:
            self.misses += 1
        else:
            self.hits += 1
            self._data.move_to_end(key)
        return ids

    def _store(self, key: Hashable, ids: tuple[int, ...]) -> None:
        self._data[key] = ids
        self._data.move_to_end(key)
        if len(self._data) > self.maxsize:
            self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, text: object) -> bool:
        return text in self._data

    def copy(self) -> SegmentCache:
        """A new cache with the same entries (e.g. to fork a conversation)."""
        new = SegmentCache(self.maxsize)
        new._data = self._data.copy()
        return new

    def clear(self) -> None:
        """Forget every entry (and the hit/miss counts)."""
        self._data.clear()
        self.hits = self.misses = 0
