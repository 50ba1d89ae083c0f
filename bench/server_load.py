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

`--peer mlx_lm` also starts `mlx_lm.server` on the same checkpoint folder (a subprocess given
this engine's fast BLAS, so both sides run the same matmuls; `--peer-blas stock` keeps the
mlx-cpu wheel's reference BLAS, as `pip install mlx-lm` gives it) and runs every client count
against both servers back to back, this engine first; `--json` writes the series and `--plot`
draws clients against aggregate decode tokens/s and time to first token. `request_max_ms` is
the slowest whole request: a stall after the first token shows there, not in TTFT.

`--check-reuse` (in-process server only) also plays each client's conversation alone, one
after the other, before the concurrent run (the pool emptied before each part), and compares
every (client, turn): batching must cost neither reuse (`cached_tokens` at least those of
the conversation played alone: `reuse_lost` lists (client, turn, difference) where not;
`reuse_gained` where a concurrent client had already computed a shared prefix) nor exactness
(greedy answers equal).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import child_env, conditions, model_path, save_plot, write_json
from engine.args import add_speculative_flags, speculative_options


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def _conversation(client, model, k, args, deadline, records, lock) -> None:
    """Client k's conversation: `args.turns` streamed turns, each resending the history."""
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
        details = usage.prompt_tokens_details  # mlx_lm.server sends none
        with lock:
            records.append({
                "client": k, "turn": t, "text": "".join(text),
                "ttft_s": (first or end) - start, "total_s": end - start,
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": details.cached_tokens if details is not None else None,
                "completion_tokens": usage.completion_tokens,
            })  # fmt: skip


def _empty_pool(eng) -> None:
    """Forget every cached prefix of the engine's pool (on its model thread)."""
    pool = eng.stateless.pool
    eng.worker.call(lambda: [s.drop_cache() for s in pool.sequences])


def _play(client, model, args, clients, deadline) -> tuple[list[dict], float]:
    """`clients` concurrent conversations; (their records, wall seconds)."""
    records: list[dict] = []
    lock = threading.Lock()
    start = time.perf_counter()
    threads = [
        threading.Thread(
            target=_conversation, args=(client, model, k, args, deadline, records, lock)
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


def run(args, clients: int, url: str | None = None, eng=None, model: str | None = None
        ) -> dict:  # fmt: skip
    """One load run of `clients` conversations against the server at `url` (None: an
    in-process server on `eng`); `model` is the name requests carry (default `args.model`)."""
    import openai

    server = None
    if url is None:
        from engine.serving.server import BackgroundServer, ServerConfig

        server = BackgroundServer(eng, ServerConfig(model=args.model, port=0, warm=False))
        url = server.start().url
    client = openai.OpenAI(base_url=url + "/v1", api_key=args.api_key or "none", max_retries=0)
    model = model or args.model
    # One warm-up request: first-call costs (kernels, allocations) are not load.
    client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "warm up"}], max_tokens=2
    )
    alone = _alone(client, args, clients, eng) if args.check_reuse and eng is not None else None
    batch_before = eng.batch_stats if eng is not None else None
    deadline = float("inf") if alone else time.monotonic() + args.time_limit
    records, elapsed = _play(client, model, args, clients, deadline)
    check = _compare(alone, records, clients, args.turns) if alone else {}
    if server is not None:
        server.stop()
    ttft = [r["ttft_s"] for r in records]
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = [r["cached_tokens"] for r in records]  # None where a server reports none
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
        "speculative": args.speculative if eng is not None else None,
        "clients": clients,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "requests": len(records),
        "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(len(records) / elapsed, 2),
        "ttft_p50_ms": round(statistics.median(ttft) * 1000, 1) if ttft else None,
        "ttft_p95_ms": round(_percentile(ttft, 0.95) * 1000, 1),
        "request_max_ms": round(max((r["total_s"] for r in records), default=0) * 1000, 1),
        "prompt_tokens": prompt,
        "cached_share": None if None in cached else round(sum(cached) / max(prompt, 1), 3),
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


# `mlx_lm.server` given this engine's BLAS choice first (it must load before mlx does).
PEER_LAUNCH = """import sys
from kernels import blas
blas.enable()
from mlx_lm.server import main
sys.argv[0] = "mlx_lm.server"
main()
"""


@contextlib.contextmanager
def mlx_lm_server(folder: Path, blas: str, log: Path, wait_s: float = 600.0):
    """`mlx_lm.server` on the checkpoint `folder`, in a subprocess on a free port; yields its
    base URL once it answers. `blas`: "fast" (this engine's) or "stock" (mlx-cpu's own)."""
    from urllib.error import HTTPError
    from urllib.request import Request, urlopen

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", PEER_LAUNCH, "--model", str(folder), "--port", str(port),
           "--log-level", "WARNING"]  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, env=child_env("1" if blas == "fast" else "0"),
                                stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + wait_s
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"mlx_lm.server exited with {proc.returncode}:\n"
                                 + log.read_text()[-2000:])  # fmt: skip
            try:
                urlopen(url + "/v1/models", timeout=5).close()
                break
            except HTTPError:
                break  # it answers
            except OSError as e:
                if time.monotonic() > deadline:
                    raise SystemExit(f"mlx_lm.server did not answer within {wait_s:.0f} s") from e
                time.sleep(0.5)
        # It loads the model on its generation thread while already answering HTTP: one
        # request now, so the loading never overlaps a measurement of either server.
        body = {"model": "default_model", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1}  # fmt: skip
        request = Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                          {"Content-Type": "application/json"})  # fmt: skip
        urlopen(request, timeout=wait_s).close()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _print(result: dict) -> None:
    for key, value in result.items():
        print(f"{key:>18}: {value}")
    print(json.dumps(result), flush=True)


def plot(series: dict[str, list[dict]], title: str, file: str) -> None:
    """Clients against aggregate decode tokens/s and TTFT p50/p95, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for (name, rows), color in zip(series.items(), ("C0", "C1")):
        clients = [r["clients"] for r in rows]
        ax1.plot(clients, [r["decode_tps"] for r in rows], "o-", color=color, label=name)
        ax2.plot(clients, [r["ttft_p50_ms"] / 1000 for r in rows], "o-", color=color,
                 label=f"{name} p50")  # fmt: skip
        ax2.plot(clients, [r["ttft_p95_ms"] / 1000 for r in rows], "s--", color=color,
                 label=f"{name} p95")  # fmt: skip
    ax1.set_ylabel("aggregate decode tokens/s")
    ax1.set_title(title, fontsize=9)
    ax2.set_ylabel("time to first token (s)")
    ax2.set_yscale("log")
    ax2.set_xlabel("concurrent clients")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(clients, [str(c) for c in clients])
    save_plot(fig, (ax1, ax2), file)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.server_load", description=__doc__)
    p.add_argument("--model", default="tiny", help="registry name or checkpoint folder")
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
    p.add_argument("--peer", choices=["mlx_lm"], help="also run each count against this server")
    p.add_argument("--peer-blas", choices=["fast", "stock"], default="fast",
                   help="the peer's BLAS: this engine's (default) or mlx-cpu's reference one")  # fmt: skip
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="with --peer: write a PNG plot here")
    add_speculative_flags(p)  # the in-process server's drafting (`chatml serve --speculative`)
    args = p.parse_args()
    if args.check_reuse and args.url:
        p.error("--check-reuse needs the in-process server (no --url)")
    if args.peer and args.url:
        p.error("--peer runs this engine's server in-process (no --url)")
    if args.plot and not args.peer:
        p.error("--plot needs --peer")
    counts = [int(c) for c in args.clients.split(",")]
    eng, folder = None, None
    if args.url is None:
        import engine

        # A registry name is the benchmarks' build of it (no download); a peer loads the same.
        folder = model_path(args.model)
        eng = engine.load(str(folder), max_batch=args.max_batch, **speculative_options(args))
    series: dict[str, list[dict]] = {"chatml": []}
    if not args.peer:
        for clients in counts:
            series["chatml"].append(run(args, clients, args.url, eng))
            _print(series["chatml"][-1])
    else:
        series["mlx_lm"] = []
        log = Path(tempfile.mkdtemp(prefix="mlx_lm_server-")) / "stderr.log"
        with mlx_lm_server(folder, args.peer_blas, log) as peer_url:
            for clients in counts:
                series["chatml"].append(run(args, clients, None, eng))
                series["mlx_lm"].append(run(args, clients, peer_url, model="default_model"))
                ours, theirs = series["chatml"][-1], series["mlx_lm"][-1]
                _print(ours)
                _print({**theirs, "model": f"mlx_lm.server ({args.peer_blas} BLAS)"})
                print(f"{clients} clients: aggregate decode {ours['decode_tps']} vs "
                      f"{theirs['decode_tps']} tok/s ({ours['decode_tps'] / theirs['decode_tps']:.2f}x), "
                      f"TTFT p50 {ours['ttft_p50_ms']:.0f} vs {theirs['ttft_p50_ms']:.0f} ms",
                      flush=True)  # fmt: skip
    if args.json or args.plot:
        result = {"bench": "server_load", "model": args.model, "peer": args.peer,
                  "peer_blas": args.peer_blas if args.peer else None,
                  "conditions": conditions(), "series": series}  # fmt: skip
        write_json(args.json, result)
        if args.plot:
            c = result["conditions"]
            plot(series, f"server load: {args.model}, {args.turns} turns x {args.max_tokens} "
                 f"tokens per client ({c['cpu'][:30]}, {c['cores']} cores)", args.plot)  # fmt: skip


if __name__ == "__main__":
    main()
