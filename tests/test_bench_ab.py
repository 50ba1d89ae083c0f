"""bench.ab: two revisions of a repository, one command, rounds alternating A B A B."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import ab

# The repository's one file: reports its own figure, and appends it to a log outside the
# checkout (so the order of the runs shows), and imports a module from its own checkout.
FIGURE = """\
import json, sys
from here import SPEED
with open(sys.argv[1], "a") as log:
    log.write(f"{SPEED}\\n")
print("warming up")
print(json.dumps({"step_ms": {"1": 10.0, "4": SPEED}, "ok": True, "name": "x"}))
"""


def _commit(repo, speed: float, message: str) -> str:
    (repo / "here.py").write_text(f"SPEED = {speed}\n")
    (repo / "figure.py").write_text(FIGURE)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", message], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    first = _commit(repo, 20.0, "slow")
    second = _commit(repo, 15.0, "fast")
    return repo, first, second


def test_rounds_alternate_and_ratios_are_b_over_a(repo, tmp_path, capsys):
    repo, first, second = repo
    log, out = tmp_path / "order.log", tmp_path / "ab.json"
    (repo / "here.py").write_text("SPEED = 12.0\n")  # the working tree, uncommitted
    rc = ab.main(["--repo", str(repo), "--rounds", "3", "--json", str(out), first, ".", "--",
                  sys.executable, "figure.py", str(log)])  # fmt: skip
    assert rc == 0
    assert log.read_text().split() == ["20.0", "12.0"] * 3  # A B A B A B, each its own code
    result = json.loads(out.read_text())
    # Every number both report (not the boolean, not the string), B/A per round.
    assert set(result["figures"]) == {"step_ms.1", "step_ms.4"}
    assert result["figures"]["step_ms.4"]["ratio"] == [0.6] * 3
    assert result["figures"]["step_ms.4"]["median_ratio"] == 0.6
    assert result["figures"]["step_ms.1"]["median_ratio"] == 1.0
    assert [r["build"] for r in result["runs"]] == ["A", "B"] * 3
    assert "step_ms.4" in capsys.readouterr().out
    # The temporary checkout is gone; only the repository's own worktree is left.
    listed = subprocess.run(["git", "-C", str(repo), "worktree", "list"], capture_output=True,
                            text=True, check=True).stdout  # fmt: skip
    assert len(listed.strip().splitlines()) == 1


def test_keys_pick_figures(repo, tmp_path, capsys):
    repo, first, second = repo
    rc = ab.main(["--repo", str(repo), "--rounds", "1", "--key", "step_ms.4", first, second,
                  "--", sys.executable, "figure.py", str(tmp_path / "log")])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "20 -> 15 (0.750)" in printed and "step_ms.1" not in printed


def test_failures_are_named(repo, tmp_path, capsys):
    repo, first, second = repo
    log = str(tmp_path / "log")
    assert ab.main(["--repo", str(repo), "nonsense", second, "--", sys.executable,
                    "figure.py", log]) == 1  # fmt: skip
    assert "no commit named 'nonsense'" in capsys.readouterr().err
    assert ab.main(["--repo", str(repo), first, second, "--", sys.executable, "-c",
                    "print('no figures here')"]) == 1  # fmt: skip
    err = capsys.readouterr().err
    assert "build A" in err and "no line of JSON" in err and "no figures here" in err
    assert ab.main(["--repo", str(repo), first, second, "--", sys.executable, "-c",
                    "import sys; print('broken'); sys.exit(3)"]) == 1  # fmt: skip
    err = capsys.readouterr().err
    assert "exited with 3" in err and "broken" in err
    assert ab.main(["--repo", str(repo), "--key", "step_ms.9", first, second, "--",
                    sys.executable, "figure.py", log]) == 1  # fmt: skip
    assert "no number at 'step_ms.9'" in capsys.readouterr().err
    assert (tmp_path / "log").read_text().split() == ["20.0"]  # said after the first run
    assert ab.main([first, second]) == 2  # no command
    assert "after `--`" in capsys.readouterr().err
