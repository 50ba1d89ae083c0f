"""Load test of `chatml serve`: `python -m bench.server_load [--clients 1,2,4,8 --turns 5 ...]`.

Starts the server in-process on 127.0.0.1 (a free port) unless `--url` points at one, then,
for each count in `--clients`, runs that many concurrent conversations of `--turns` turns each,
streaming, every request resending the whole conversation (as OpenAI clients do). Bounded by
request count and by `--time-limit` seconds. Reports requests/s, aggregate and per-client
decode tokens/s (completion tokens over the wall time), p50/p95 time to first token (first
streamed chunk with text, measured at the client), the share of prompt tokens served from the
cache, and the server's batch counters (mean and widest batch). `--max-batch 1` serves one
request at a time (the baseline); `--url` of an `mlx_lm.server` measures that peer. Prints a
table per count, then one JSON line each.

`--check-reuse` (in-process server only) also plays each client's conversation alone, one
after the other, before the concurrent run (the pool emptied before each part), and compares
every (client, turn): batching must cost neither reuse (`cached_tokens` at least those of
the conversation played alone: `reuse_lost` lists (client, turn, difference) where not;
`reuse_gained` where a concurrent client had already computed a shared prefix) nor exactness
(greedy answers equal).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def _conversation(client, model, k, args, deadline, records, lock) -> None:
    messages = [{"role": "system", "content": args.system}]
    for t in range(args.turns):
        if time.monotonic() > deadline:
            return
        messages.append({"role": "user", "content": f"Client {k}, question {t}: " + args.question})
        start, first, text, usage = time.perf_counter(), None, [], None
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=args.max_tokens, temperature=0,
            presence_penalty=0,  # plain greedy, whatever the checkpoint's defaults say
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first or time.perf_counter()
                    text.append(choice.delta.content)
        end = time.perf_counter()
        messages.append({"role": "assistant", "content": "".join(text)})
        with lock:
            records.append({
                "client": k, "turn": t, "text": "".join(text),
                "ttft_s": (first or end) - start, "total_s": end - start,
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                "completion_tokens": usage.completion_tokens,
            })  # fmt: skip


def _empty_pool(eng) -> None:
    """Forget every cached prefix of the engine's pool (on its model thread)."""
    pool = eng.stateless.pool
    eng.worker.call(lambda: [s.drop_cache() for s in pool.sequences])


def _play(client, args, clients, deadline) -> tuple[list[dict], float]:
    """`clients` concurrent conversations; (their records, wall seconds)."""
    records: list[dict] = []
    lock = threading.Lock()
    start = time.perf_counter()
    threads = [
        threading.Thread(
            target=_conversation, args=(client, args.model, k, args, deadline, records, lock)
        )
        for k in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - start


def _alone(client, args, clients, eng) -> dict:
    """Each conversation played alone on an empty pool: {(client, turn): record}."""
    alone = {}
    for k in range(clients):
        _empty_pool(eng)
        records: list[dict] = []
        _conversation(client, args.model, k, args, float("inf"), records, threading.Lock())
        alone.update({(r["client"], r["turn"]): r for r in records})
    _empty_pool(eng)
    return alone


def _compare(alone: dict, records: list[dict], clients: int, turns: int) -> dict:
    """The concurrent run's cached tokens and answers against the conversations alone."""
    together = {(r["client"], r["turn"]): r for r in records}

    def delta(key):
        return together[key]["cached_tokens"] - alone[key]["cached_tokens"]

    text = [list(key) for key, r in together.items() if r["text"] != alone[key]["text"]]
    return {
        "all_turns_played": len(together) == len(alone),
        # Fewer cached tokens than alone would be reuse lost to batching; more is a prefix
        # (the shared system prompt) another client's request had already computed.
        "reuse_lost": [[*key, delta(key)] for key in together if delta(key) < 0],
        "reuse_gained": [[*key, delta(key)] for key in together if delta(key) > 0],
        "answers_equal_to_alone": not text and len(together) == len(alone),
        "answers_differ": text,
        "cached_tokens_by_turn": [
            [together[(k, t)]["cached_tokens"] for k in range(clients)] for t in range(turns)
        ],
    }


def run(args, clients: int, url: str | None = None, eng=None) -> dict:
    import openai

    server = None
    if url is None:
        from engine.serving.server import BackgroundServer, ServerConfig

        server = BackgroundServer(eng, ServerConfig(model=args.model, port=0, warm=False))
        url = server.start().url
    client = openai.OpenAI(base_url=url + "/v1", api_key=args.api_key or "none", max_retries=0)
    # One warm-up request: first-call costs (kernels, allocations) are not load.
    client.chat.completions.create(
        model=args.model, messages=[{"role": "user", "content": "warm up"}], max_tokens=2
    )
    alone = _alone(client, args, clients, eng) if args.check_reuse and eng is not None else None
    batch_before = eng.batch_stats if eng is not None else None
    deadline = float("inf") if alone else time.monotonic() + args.time_limit
    records, elapsed = _play(client, args, clients, deadline)
    check = _compare(alone, records, clients, args.turns) if alone else {}
    if server is not None:
        server.stop()
    ttft = [r["ttft_s"] for r in records]
    prompt = sum(r["prompt_tokens"] for r in records)
    completion = sum(r["completion_tokens"] for r in records)
    batch = {}
    if batch_before is not None:
        after = eng.batch_stats
        steps = after["steps"] - batch_before["steps"]
        batch = {"batched_steps": steps, "widest_batch": after["widest"],
                 "mean_batch": round((after["rows"] - batch_before["rows"]) / max(steps, 1), 2)}  # fmt: skip
    return {
        "bench": "server_load",
        "model": args.model,
        "max_batch": args.max_batch if eng is not None else None,
        "clients": clients,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "requests": len(records),
        "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(len(records) / elapsed, 2),
        "ttft_p50_ms": round(statistics.median(ttft) * 1000, 1) if ttft else None,
        "ttft_p95_ms": round(_percentile(ttft, 0.95) * 1000, 1),
        "prompt_tokens": prompt,
        "cached_share": round(sum(r["cached_tokens"] for r in records) / max(prompt, 1), 3),
        "completion_tokens": completion,
        "decode_tps": round(completion / elapsed, 2),
        "per_client_tps": round(completion / elapsed / clients, 2),
        **batch,
        **check,
        "uptime": _uptime(),
        "platform": f"{platform.system()} {platform.machine()}",
    }


def _uptime() -> str:
    try:
        with open("/proc/loadavg") as f:
            return "load " + " ".join(f.read().split()[:3])
    except OSError:
        return ""


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.server_load", description=__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--url", default=None, help="a running server (default: start one here)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", default="4", help="comma-separated concurrent client counts")
    p.add_argument("--max-batch", type=int, default=8, help="the in-process server's batch")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--time-limit", type=float, default=60.0, help="no new request after this")
    p.add_argument("--system", default="You are a helpful assistant. " * 20)
    p.add_argument("--question", default="please explain how the cache is reused. " * 4)
    p.add_argument("--check-reuse", action="store_true",
                   help="compare each conversation's cached tokens and answers with it alone")  # fmt: skip
    args = p.parse_args()
    if args.check_reuse and args.url:
        p.error("--check-reuse needs the in-process server (no --url)")
    eng = None
    if args.url is None:
        import engine

        eng = engine.load(args.model, max_batch=args.max_batch)
    for clients in (int(c) for c in args.clients.split(",")):
        result = run(args, clients, args.url, eng)
        for key, value in result.items():
            print(f"{key:>18}: {value}")
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
