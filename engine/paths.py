"""Where chatml-engine keeps its files, and how it writes them safely."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Folders that hold conversations or states computed from them (sessions, the prefix cache):
# the user's alone, as a shell's history is. Their files are 0600 (`atomic_write`'s mkstemp,
# the session log). Folders made before keep their modes.
PRIVATE_DIR = 0o700


def chatml_home() -> Path:
    """Root for built models, the tokenizer and sessions: `CHATML_HOME` or the user cache."""
    env = os.environ.get("CHATML_HOME")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_path

    return user_cache_path("chatml-engine")


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one, never half.

    The bytes go to a temporary file in the same folder, are fsynced, then renamed over `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
