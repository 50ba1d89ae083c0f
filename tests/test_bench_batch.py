"""Smoke test of `python -m bench.batch` on tiny: batch sizes and `--dense-rows` variants
interleaved, each variant routing the few-row products as it says."""

import json

from bench import batch
from kernels import native


class Counting:
    """`native.module()` with its dense GEMV calls recorded: (the row table in force, rows)."""

    def __init__(self, mod, calls: list):
        self._mod, self._calls = mod, calls

    def __getattr__(self, name):
        return getattr(self._mod, name)

    def dense_gemv(self, x, w):
        self._calls.append((native.DENSE_ROWS[native.info().isa], x.shape[0]))
        return self._mod.dense_gemv(x, w)


def test_batch_bench_times_each_dense_rows_variant(monkeypatch, capsys):
    mod = native.module()
    assert mod is not None, native.info().reason  # a compiler is present in CI: it must build
    table = dict(native.DENSE_ROWS)
    calls: list = []
    monkeypatch.setattr(native, "module", lambda: Counting(mod, calls))
    argv = ["python -m bench.batch", "--model", "tiny", "--batch", "1,2", "--context", "8",
            "--steps", "2", "--repeats", "1", "--dense-rows", "1-2,none,default"]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    batch.main()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for label in ("auto", "auto/rows=1-2", "auto/rows=none"):
        assert result[label]["step_ratio"]["1"] == 1.0
        assert all(ms > 0 for ms in result[label]["step_ms"].values())
    tables = {t for t, _ in calls}
    assert (1, 2) in tables  # the 1-2 variant took the native GEMV...
    assert (1, 0) not in tables  # ...and "none" never did
    # "default", run after both, used the table as found on its two-row steps (the prefills
    # before it only put one row, the last position's logits, through the kernel)
    assert (table[native.info().isa], 2) in calls
    assert native.DENSE_ROWS == table  # the bench leaves the table as it found it


def test_batch_bench_checks_each_row_against_the_row_alone(monkeypatch, capsys):
    argv = ["python -m bench.batch", "--model", "tiny", "--batch", "1,3", "--context", "8",
            "--steps", "3", "--repeats", "1", "--check"]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    batch.main()
    lines = capsys.readouterr().out.strip().splitlines()
    check = json.loads(lines[-1])["check"]
    assert check["tokens_equal"] is True
    assert set(check["max_logit_diff"]) == {"1", "3"}
    assert check["max_logit_diff"]["1"] == 0.0  # a row alone twice: the same bits
    assert check["max_logit_diff"]["3"] < 1e-4
    assert lines[-2].startswith("check: max |logit difference|")


def test_the_check_sees_a_row_that_decodes_differently_in_a_batch(monkeypatch):
    """The comparison itself: a batched pass that perturbs one row's logits is reported."""
    from engine.runtime import step

    forward = step.forward

    def perturbed(model, rows):
        out = forward(model, rows)
        if len(rows) > 1:
            lg, mark = out[-1]
            out[-1] = (lg + 1e-3, mark)
        return out

    monkeypatch.setattr(step, "forward", perturbed)
    result = batch.run("tiny", [1, 2], context=8, steps=2, repeats=1, check=True)
    assert result["check"]["max_logit_diff"]["1"] == 0.0
    assert abs(result["check"]["max_logit_diff"]["2"] - 1e-3) < 1e-5
