"""Storage: conversations on disk. The checksummed session log, the state file that holds a
sequence's caches, and `SessionStore`, which ties them to a live Session. Sits on `runtime`;
nothing in `runtime` or `serving` imports it."""

from .store import SessionStore

__all__ = ["SessionStore"]
