"""Two builds, one benchmark, in alternating rounds: `python -m bench.ab A B -- COMMAND`.

For example `python -m bench.ab HEAD~1 . --rounds 3 --key auto.step_ms.4 -- python -m
bench.batch --batch 1,4 --clock cpu`.

On a shared machine a figure moves with the moment more than with a 5-10% change, so builds
measured in separate runs decide nothing. A and B are git revisions of this repository (`.`:
the working tree as it is, uncommitted changes included); each revision is checked out with
`git worktree add --detach` in a temporary folder, removed afterwards. The command after `--`
runs from each checkout in turn, A B A B ..., `--rounds` times, each run a process of its own
with the checkout first on PYTHONPATH (the native kernels build once per source, cached under
CHATML_HOME). A run's result is the last line of its standard output that parses as a JSON
object; `--key` picks figures from it by dotted path (`auto.step_ms.4`); without `--key`, every
number both builds report. Prints each key's values per round, B/A per round and its median,
with the load average before each run; `--json` writes the whole record. A failed run stops
the comparison and shows the tail of its output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench.common import cpu_model, write_json

TAIL = 2000  # characters of a failed run's output shown


class ABError(RuntimeError):
    """A revision that cannot be checked out, or a run that fails or reports nothing."""


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if done.returncode:
        raise ABError(f"git {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip()


@contextlib.contextmanager
def checkouts(repo: Path, revisions: list[str]) -> Iterator[list[Path]]:
    """A folder per revision: the repository itself for `.`, else a detached worktree."""
    made: list[Path] = []
    scratch = Path(tempfile.mkdtemp(prefix="chatml-ab-"))
    try:
        folders = []
        for i, rev in enumerate(revisions):
            if rev == ".":
                folders.append(repo)
                continue
            try:
                commit = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
            except ABError:
                raise ABError(f"no commit named {rev!r} in {repo}") from None
            folder = scratch / f"{i}-{commit[:10]}"
            _git(repo, "worktree", "add", "--detach", "--quiet", str(folder), commit)
            made.append(folder)
            folders.append(folder)
        yield folders
    finally:
        for folder in made:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(folder)],
                           capture_output=True)  # fmt: skip
        shutil.rmtree(scratch, ignore_errors=True)


def last_json(output: str) -> dict | None:
    """The last line of `output` that is a JSON object."""
    for line in reversed(output.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


def numbers(result: dict, prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of a JSON object, by dotted path (booleans are not numbers)."""
    out = {}
    for name, value in result.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict):
            out.update(numbers(value, path + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[path] = float(value)
    return out


def run_once(folder: Path, command: list[str], label: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    output = done.stdout + done.stderr
    if done.returncode:
        raise ABError(f"build {label} ({folder}): {' '.join(command)} exited with "
                      f"{done.returncode}:\n{output[-TAIL:]}")  # fmt: skip
    result = last_json(done.stdout)
    if result is None:
        raise ABError(f"build {label} ({folder}): no line of JSON in the output of "
                      f"{' '.join(command)}:\n{output[-TAIL:]}")  # fmt: skip
    return result


def compare(repo: Path, revisions: list[str], command: list[str], rounds: int,
            keys: list[str] | None, log=print) -> dict:  # fmt: skip
    """Run `command` from each revision's checkout in turn, `rounds` times; B/A per key."""
    labels = ["A", "B"]
    runs: list[dict] = []
    found: list[dict[str, float]] = []  # each run's numbers, by dotted path
    with checkouts(repo, revisions) as folders:
        for r in range(rounds):
            for label, folder in zip(labels, folders, strict=True):
                load = os.getloadavg()
                log(f"round {r + 1}/{rounds}, build {label}: load {load[0]:.2f}")
                result = run_once(folder, command, label)
                found.append(numbers(result))
                missing = [k for k in keys or () if k not in found[-1]]
                if missing:  # said at once, not after the last round
                    raise ABError(f"no number at {', '.join(map(repr, missing))} in the result "
                                  f"of build {label}: {sorted(found[-1])}")  # fmt: skip
                runs.append({"round": r, "build": label, "load": list(load), "result": result})
    if keys is None:
        keys = sorted(set.intersection(*(set(f) for f in found)))
    figures = {}
    for key in keys:
        a = [f[key] for run, f in zip(runs, found) if run["build"] == "A"]
        b = [f[key] for run, f in zip(runs, found) if run["build"] == "B"]
        ratios = [y / x if x else None for x, y in zip(a, b)]
        known = [q for q in ratios if q is not None]
        figures[key] = {"A": a, "B": b, "ratio": ratios,
                        "median_ratio": statistics.median(known) if known else None}  # fmt: skip
    return {"bench": "ab", "revisions": dict(zip(labels, revisions)), "command": command,
            "rounds": rounds, "figures": figures, "runs": runs,
            "cpu": cpu_model(), "cores": os.cpu_count()}  # fmt: skip


def report(result: dict) -> str:
    a, b = result["revisions"]["A"], result["revisions"]["B"]
    lines = [f"A = {a}, B = {b}; B/A per round, then the median"]
    width = max([len(k) for k in result["figures"]] + [3])
    for key, f in result["figures"].items():
        rounds = "  ".join(f"{x:.4g} -> {y:.4g} ({q:.3f})" if q is not None else f"{x:.4g} -> {y:.4g}"
                           for x, y, q in zip(f["A"], f["B"], f["ratio"]))  # fmt: skip
        median = "-" if f["median_ratio"] is None else f"{f['median_ratio']:.3f}"
        lines.append(f"{key:>{width}}  {rounds}  median {median}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    own, command = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("a", help="revision A (the baseline), or `.` for the working tree")
    p.add_argument("b", help="revision B, or `.` for the working tree")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--key", action="append", help="dotted path of a figure (repeatable)")
    p.add_argument("--repo", default=".", help="the git repository (default: here)")
    p.add_argument("--json", help="write the whole record here")
    args = p.parse_args(own)
    if not command:
        print("bench.ab: give the benchmark's command after `--`, e.g. "
              "`python -m bench.ab HEAD~1 . -- python -m bench.batch --batch 1,4`",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, not {args.rounds}")
    repo = Path(args.repo).resolve()
    if command[0] in ("python", "python3"):
        command = [sys.executable, *command[1:]]  # this environment's interpreter
    try:
        top = Path(_git(repo, "rev-parse", "--show-toplevel"))
        result = compare(top, [args.a, args.b], command, args.rounds, args.key,
                         log=lambda s: print(s, file=sys.stderr))  # fmt: skip
    except ABError as e:
        print(f"bench.ab: {e}", file=sys.stderr)
        return 1
    print(report(result))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
