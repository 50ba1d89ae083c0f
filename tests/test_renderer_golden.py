"""Hand-written golden cases (tests/golden/*.json -> *.txt, made once by the official template)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_renderer_support import reference_render  # noqa: E402

from renderer import RenderError, render_messages  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "golden"
CASES = sorted(GOLDEN.glob("*.json"))


def _load(path: Path) -> tuple[dict, dict]:
    data = json.loads(path.read_text(encoding="utf-8"))
    kwargs = {k: v for k, v in data.items() if k not in ("messages", "error")}
    return data, kwargs


def test_enough_cases() -> None:
    assert len(CASES) >= 36
    assert sum(1 for p in CASES if "error" in p.read_text(encoding="utf-8")) >= 8


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_golden(path: Path) -> None:
    data, kwargs = _load(path)
    if data.get("error"):
        with pytest.raises(RenderError):
            render_messages(data["messages"], **kwargs)
        return
    expected = path.with_suffix(".txt").read_bytes().decode("utf-8")
    assert render_messages(data["messages"], **kwargs) == expected


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_golden_still_matches_template(path: Path) -> None:
    # Guards the stored files themselves: the official template still renders them the same.
    data, kwargs = _load(path)
    variant = kwargs.pop("variant")
    if data.get("error"):
        with pytest.raises(Exception):  # noqa: B017 - the template raises various types
            reference_render(data["messages"], variant, **kwargs)
        return
    expected = path.with_suffix(".txt").read_bytes().decode("utf-8")
    assert reference_render(data["messages"], variant, **kwargs) == expected
