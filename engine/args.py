"""argparse types shared by the `chatml` commands (chat, serve)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(minimum: float, maximum: float | None = None, kind=int) -> Callable[[str], float]:
    """An argparse type: a `kind` in [minimum, maximum] (a usage error naming the flag if not)."""
    what = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {text}")
        return value

    return parse


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with each option's default, except where there is none to show (None, off)
    or the help already says it in words."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if any(action.default is v for v in (None, False, argparse.SUPPRESS)) or "default" in text:
            return text
        return super()._get_help_string(action)
