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


# Sampling flags of `chatml chat` and `chatml serve`: (flag, SamplingParams field, type, help).
_SAMPLING_FLAGS = (
    ("--temperature", "temperature", number(0.0, kind=float), "0 is greedy"),
    ("--top-p", "top_p", number(0.0, 1.0, kind=float), "nucleus mass kept, in (0, 1]"),
    ("--top-k", "top_k", number(0), "most likely tokens kept (0: all)"),
    ("--min-p", "min_p", number(0.0, 1.0, kind=float), "drop tokens below MIN_P x the best"),
    ("--presence-penalty", "presence_penalty", number(-2.0, 2.0, kind=float),
     "subtracted once from tokens already in the answer"),
    ("--frequency-penalty", "frequency_penalty", number(-2.0, 2.0, kind=float),
     "subtracted per occurrence in the answer"),
    ("--repetition-penalty", "repetition_penalty", number(0.0, kind=float),
     "divides recent tokens' logits (1: off)"),
)  # fmt: skip


def add_sampling_flags(parser: argparse.ArgumentParser, what: str) -> None:
    """The sampling flags; each left unset takes the model's generation_config.json value."""
    group = parser.add_argument_group(
        "sampling", f"defaults for {what}: the model's generation_config.json (shown by "
        "`chatml models info`); a flag replaces that one value",
    )  # fmt: skip
    for flag, dest, kind, text in _SAMPLING_FLAGS:
        group.add_argument(flag, dest=dest, type=kind, default=None, help=text)


def sampling_overrides(args: argparse.Namespace) -> dict:
    """The sampling flags given on the command line; ValueError if they cannot work together
    (e.g. --top-p 0), so the problem shows before a model loads."""
    from .runtime.sampling import SamplingParams

    given = {dest: getattr(args, dest, None) for _, dest, _, _ in _SAMPLING_FLAGS}
    given = {k: v for k, v in given.items() if v is not None}
    SamplingParams(**given)
    return given


def _drafter(value: str) -> str:
    if value in ("lookup", "mtp") or (value.startswith("draft:") and value[6:].strip()):
        return value
    raise argparse.ArgumentTypeError(f"expected lookup, mtp or draft:NAME, got {value!r}")


def add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    """`--speculative` and `--num-draft`: passed to `engine.load` as they are."""
    parser.add_argument("--speculative", type=_drafter, default=None,
                        metavar="{lookup,mtp,draft:NAME}",
                        help="draft tokens and verify them in one step (lookup: n-grams of "
                        "the conversation; mtp: the checkpoint's MTP head; draft:NAME: a "
                        "smaller model with the same tokenizer); greedy output unchanged")  # fmt: skip
    parser.add_argument("--num-draft", type=number(1, 8), default=4,
                        help="most tokens drafted per step (with --speculative)")  # fmt: skip


def speculative_options(args: argparse.Namespace) -> dict:
    """The `engine.load` keywords of `add_speculative_flags`; ValueError (before a model
    loads) for a drafter that is not available."""
    from .engine import speculation

    options = {"speculative": getattr(args, "speculative", None),
               "num_draft": getattr(args, "num_draft", 4)}  # fmt: skip
    speculation(options["speculative"], options["num_draft"])
    return options


def add_shard_flags(parser: argparse.ArgumentParser) -> None:
    """`--shard`: passed to `engine.load` (run the command under `mlx.launch`)."""
    parser.add_argument("--shard", choices=["pipeline"], default=None,
                        help="split the layers over the processes of an `mlx.launch` group "
                        "(rank 0 answers; the other ranks serve it)")  # fmt: skip


def shard_rank(args: argparse.Namespace) -> int:
    """This process's rank in the launched group with --shard (0 without it): the commands
    open their terminal or port on rank 0 only."""
    if getattr(args, "shard", None) is None:
        return 0
    from .runtime.shard import join_group

    return join_group().rank()
