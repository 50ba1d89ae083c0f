"""The disk tier of the prefix cache: TTFT after a restart, read/write cost, evictions.

Run: ``chatml bench disk_cache --model qwen3.5-0.8b [--lengths 1024,4096,16384] [--turns 20]
[--budget-mib 48] [--json FILE]``.

Two parts, on one engine (float32 on a CPU), through ``Engine.chat`` (the server's path):

- restart: for each prompt length, a system prompt of about that many tokens and a short
  question are answered on a fresh disk folder (a full prefill: the "prefill" TTFT; the turn
  writes its resume points to disk). Then the pool is emptied, the folder reopened (what a
  restarted server does: index, no RAM state) and the page cache of its files dropped
  (``posix_fadvise(DONTNEED)``, so reads come from the disk, not from RAM), and the same
  conversation is sent again: the "disk" TTFT (read, check, restore, prefill the rest). The
  answers must be identical (float32: restored equals computed). Read cost is one
  ``DiskCache.restore`` of that entry, cold; write cost is the capture on the model thread
  (MLX to numpy) plus encode (checksum, safetensors) plus the atomic write with fsync.
- evictions: the 20-turn scripted conversation (bench/conversation.py), all messages kept,
  with a RAM budget (``--budget-mib``) smaller than its cache, so its state leaves RAM; once
  without a disk tier and once with one. The share of the summed TTFT the disk tier saves.
  A turn resumes from a file (``reads``) or, if the writer has not written that entry yet,
  from its copy in RAM (``memory_reads``).

Every row records the load average at its end (``load_average``): figures taken at different
loads do not compare; the ratios within a row do.

The answers of random weights are noise; both runs of a part see the same prompts (exact
restores give the same answers), so their TTFTs compare like for like.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from .common import conditions, model_path, write_json
from .conversation import SYSTEM, USER_TURNS

MiB = 1 << 20
FILLER = (
    "Reference notes for the assistant, section {i}: orders ship within two working days; "
    "express parcels leave the same evening; refunds go back to the original card. "
)


def system_of(tokenizer, n: int) -> str:
    """A system prompt of about `n` tokens (numbered sections, so no two are alike)."""
    parts, used, i = [], 0, 0
    while used < n:
        part = FILLER.format(i=i)
        used += len(tokenizer.encode(part))
        parts.append(part)
        i += 1
    return "".join(parts)


def drop_page_cache(folder: Path) -> None:
    """Evict the folder's files from the page cache (clean pages: written and fsynced)."""
    for path in folder.glob("*/*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def restart_row(eng, n: int, folder: Path) -> dict:
    from engine.paths import atomic_write
    from engine.storage.state_file import capture_state

    messages = [
        {"role": "system", "content": system_of(eng.tokenizer, n)},
        {"role": "user", "content": "Do you ship to Norway?"},
    ]
    pool = eng.stateless.pool
    pool.sequences.clear()
    disk = eng.attach_disk(folder)
    cold = eng.chat(messages, max_tokens=8, warm=False)
    disk.flush()
    # The write cost of the entry this conversation resumes from, measured on its own.
    seq = pool.sequences[0]
    pos = max(p for p in seq.snapshots if p <= cold.stats.prompt_tokens - 1)
    t = time.perf_counter()
    captured = eng.worker.call(capture_state, seq, eng, pos)
    capture_s = time.perf_counter() - t
    t = time.perf_counter()
    data = captured.encode()
    encode_s = time.perf_counter() - t
    scratch = folder / "scratch.safetensors"
    t = time.perf_counter()
    atomic_write(scratch, data)
    write_s = time.perf_counter() - t
    scratch.unlink()
    # The restart: no RAM state, the folder indexed afresh, its files out of the page cache.
    pool.sequences.clear()
    disk = eng.attach_disk(folder)
    drop_page_cache(folder)
    entry = disk.lookup(cold.prompt_ids)
    t = time.perf_counter()
    ok = eng.worker.call(disk.restore, entry) is not None
    read_s = time.perf_counter() - t
    assert ok, "the entry failed its checks"
    pool.sequences.clear()
    disk = eng.attach_disk(folder)
    drop_page_cache(folder)
    warm = eng.chat(messages, max_tokens=8, warm=False)
    assert warm.token_ids == cold.token_ids, "restored answer differs from the computed one"
    mib = len(data) / MiB
    row = {
        "prompt_tokens": cold.stats.prompt_tokens,
        "entry_tokens": entry.tokens,
        "entry_mib": round(mib, 1),
        "ttft_prefill_s": round(cold.stats.ttft_s, 3),
        "ttft_disk_s": round(warm.stats.ttft_s, 3),
        "speedup": round(cold.stats.ttft_s / warm.stats.ttft_s, 1),
        "reused_tokens": warm.stats.reused_tokens,
        "read_s_per_mib": round(read_s / mib, 5),
        "capture_s_per_mib": round(capture_s / mib, 5),
        "encode_s_per_mib": round(encode_s / mib, 5),
        "write_s_per_mib": round(write_s / mib, 5),
        "prefill_s_per_mib": round(cold.stats.ttft_s / mib, 5),
        "same_answer": True,
        "load_average": [round(x, 2) for x in os.getloadavg()],  # at the row's end
    }
    eng.detach_disk()
    return row


def replay(eng, turns: int, budget: int, folder: Path | None, max_tokens: int) -> list[dict]:
    """The scripted conversation through Engine.chat under a RAM budget; TTFT per turn."""
    eng.detach_disk()
    eng.stateless.pool.sequences.clear()
    if folder is not None:
        eng.attach_disk(folder)
    saved, eng.budget.max_bytes = eng.budget.max_bytes, budget
    rows, messages = [], [{"role": "system", "content": SYSTEM}]
    try:
        for i, text in enumerate(USER_TURNS[:turns]):
            messages.append({"role": "user", "content": text})
            t = eng.chat(messages, max_tokens=max_tokens, warm=False)
            messages.append(t.message())
            rows.append(
                {
                    "turn": i + 1,
                    "prompt_tokens": t.stats.prompt_tokens,
                    "reused_tokens": t.stats.reused_tokens,
                    "ttft_s": round(t.stats.ttft_s, 3),
                    "tokens": t.token_ids,
                    "load_average": [round(x, 2) for x in os.getloadavg()],
                }  # fmt: skip
            )
            print(f"  turn {i + 1}: {t.stats.prompt_tokens} tokens, reused "
                  f"{t.stats.reused_tokens}, TTFT {t.stats.ttft_s:.2f} s", file=sys.stderr)  # fmt: skip
        if eng.disk is not None:
            d = eng.disk
            rows.append({"disk": {"writes": d.writes, "reads": d.reads,
                                  "memory_reads": d.memory_reads, "mib": d.nbytes / MiB,
                                  "evictions": eng.budget.evictions}})  # fmt: skip
    finally:
        eng.budget.max_bytes = saved
        eng.detach_disk()
    return rows


def run(model: str, lengths: list[int], turns: int, budget_mib: int, max_tokens: int,
        models_dir: str | None = None, save=None, eng=None) -> dict:  # fmt: skip
    """Both parts; `save(result)` after each step (a slow run keeps what it measured).
    `eng`: that model already loaded (a test's), used and left open; else loaded and closed."""
    import engine as chatml

    owned = eng is None
    if owned:
        eng = chatml.load(model_path(model, models_dir))
    eng.chat([{"role": "user", "content": "warm-up"}], max_tokens=2, warm=False)
    result = {"conditions": conditions(model=model, dtype=str(eng.dtype)), "restart": [],
              "evictions": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="chatml-disk-bench-") as tmp:
        for n in lengths:
            print(f"restart, {n} tokens", file=sys.stderr)
            row = restart_row(eng, n, Path(tmp) / f"r{n}")
            print(f"  {json.dumps(row)}", file=sys.stderr)
            result["restart"].append(row)
            if save:
                save(result)
        if turns:
            budget = budget_mib * MiB
            for name, folder in (("ram_only", None), ("disk", Path(tmp) / "replay")):
                print(f"replay, {name}, RAM budget {budget_mib} MiB", file=sys.stderr)
                result["evictions"][name] = replay(eng, turns, budget, folder, max_tokens)
                if save:
                    save(result)
    ram = [r for r in result["evictions"].get("ram_only", []) if "turn" in r]
    disk = [r for r in result["evictions"].get("disk", []) if "turn" in r]
    if ram and disk:
        assert [r["tokens"] for r in ram] == [r["tokens"] for r in disk], "answers differ"
        a, b = sum(r["ttft_s"] for r in ram), sum(r["ttft_s"] for r in disk)
        result["summary"] = {"budget_mib": budget_mib, "turns": len(ram),
                             "ttft_sum_ram_only_s": round(a, 2), "ttft_sum_disk_s": round(b, 2),
                             "saved_share": round(1 - b / a, 3)}  # fmt: skip
    if owned:
        eng.close()
    return result


def print_table(result: dict) -> None:
    print(
        "| prompt tokens | entry MiB | TTFT prefill s | TTFT from disk s | ratio | read s/MiB"
        " | capture + encode + write s/MiB |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in result["restart"]:
        w = r["capture_s_per_mib"] + r["encode_s_per_mib"] + r["write_s_per_mib"]
        print(f"| {r['prompt_tokens']} | {r['entry_mib']} | {r['ttft_prefill_s']} | "
              f"{r['ttft_disk_s']} | {r['speedup']}x | {r['read_s_per_mib']} | "
              f"{r['capture_s_per_mib']} + {r['encode_s_per_mib']} + {r['write_s_per_mib']}"
              f" = {w:.4f} |")  # fmt: skip
    if "summary" in result:
        print(json.dumps(result["summary"]))


def main(argv: list[str] | None = None, eng=None) -> None:
    """The command line (`argv`: sys.argv[1:] by default; `eng`: see `run`)."""
    ap = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="registry name or checkpoint folder")
    ap.add_argument("--lengths", default="1024,4096,16384", help="prompt lengths (tokens)")
    ap.add_argument("--turns", type=int, default=20, help="replay turns (0: skip the replay)")
    ap.add_argument("--budget-mib", type=int, default=48, help="RAM budget during the replay")
    ap.add_argument("--max-tokens", type=int, default=16, help="answer tokens per turn (at most)")
    ap.add_argument("--models-dir", help="where big checkpoints are built and cached")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",") if x]
    result = run(a.model, lengths, a.turns, a.budget_mib, a.max_tokens, a.models_dir,
                 save=lambda r: write_json(a.json, r), eng=eng)  # fmt: skip
    print_table(result)
    write_json(a.json, result)


if __name__ == "__main__":
    main()
