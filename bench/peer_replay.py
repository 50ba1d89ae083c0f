"""The scripted chat through two OpenAI endpoints: time to first token per turn, chatml serve vs llama-server.

Run: ``chatml bench peer_replay --model qwen3.5-0.8b [--format f32] [--turns 20]
[--max-tokens 16] [--threads 2] [--json FILE]``. Not part of CI: it needs the llama.cpp build
and GGUF files that ``chatml bench peer`` makes (and makes them when missing, ~15 minutes).

Both servers run on the same random-weight checkpoint at the matching precision (``f32`` with
float32, ``q8_0`` with ``--quantize 8``, ``q4_k_m`` with ``--quantize 4``), each with
``--threads`` threads: ``llama-server -t N -tb N --jinja`` with its defaults otherwise (its
prompt cache and context checkpoints on), and ``chatml serve --no-disk-cache --no-warm``: no
prefixes from an earlier run, and no idle-time warm-up running while llama-server answers (the
two share the cores; ``--warm`` turns it back on). Each answers one short request first. The
client is the same for both, a plain HTTP client: each turn it sends the system prompt, the last six
exchanges of that server's own conversation and the next scripted message
(``bench/conversation.py``), streamed, greedy, ``--max-tokens`` tokens, thinking off; the time
to first token is taken at the first chunk that carries text. Within a turn the two servers
are asked one after the other, in alternating order, so a noisy machine hits them alike. The
JSON keeps, per turn and server, the prompt tokens and what the server reports of its cache
(``cached_tokens`` for chatml; llama-server's ``timings.prompt_n``, the tokens it evaluated).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

from bench.common import ROOT, conditions, model_path, write_json
from bench.conversation import SYSTEM, user_turns
from bench.peer import LLAMA_CPP_PYTHON, engine_env, gguf, llama_cpp

QUANTIZE = {"f32": None, "q8_0": 8, "q4_k_m": 4}  # llama.cpp format -> chatml --quantize
WINDOW = 6  # exchanges the client resends


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, proc: subprocess.Popen, name: str, timeout: float = 600) -> None:
    """Poll GET /health until it answers 200 (the model loaded); fail naming the server if it
    exits or is not ready in time (its log is in the work folder)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"bench peer_replay: {name} exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"bench peer_replay: {name} not ready after {timeout:.0f} s")


def ask(port: int, messages: list[dict], max_tokens: int) -> dict:
    """One streamed, greedy chat completion; returns its text, TTFT, total time and usage."""
    body = {
        "model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False},
    }  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"bench peer_replay: HTTP {resp.status}: {resp.read()[:300]!r}")
    text, ttft, usage, timings = [], None, None, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text.append(delta.get("content") or "")
        usage = chunk.get("usage") or usage
        timings = chunk.get("timings") or timings
    total = time.perf_counter() - t0
    conn.close()
    return {"text": "".join(text), "ttft_s": ttft, "total_s": total, "usage": usage,
            "timings": timings}  # fmt: skip


def _servers(args, ckpt: Path, gguf_path: Path, work: Path) -> dict[str, tuple]:
    """Start both servers; returns name -> (port, process)."""
    out = {}
    port = _free_port()
    llama = [str(work / "build" / "bin" / "llama-server"), "-m", str(gguf_path),
             "-t", str(args.threads), "-tb", str(args.threads), "--host", "127.0.0.1",
             "--port", str(port), "--jinja", "-c", str(args.context)]  # fmt: skip
    log = open(work / "llama-server.log", "w")  # noqa: SIM115  (open while the server runs)
    out["llama-server"] = (port, subprocess.Popen(llama, stdout=log, stderr=subprocess.STDOUT))
    port = _free_port()
    chatml = [sys.executable, "-m", "engine.cli", "serve", "--model", str(ckpt),
              "--port", str(port), "--no-disk-cache"]  # fmt: skip
    if not args.warm:
        chatml.append("--no-warm")
    if QUANTIZE[args.format]:
        chatml += ["--quantize", str(QUANTIZE[args.format])]
    log = open(work / "chatml-serve.log", "w")  # noqa: SIM115
    out["chatml"] = (port, subprocess.Popen(chatml, cwd=ROOT, env=engine_env(args.threads),
                                            stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
    for name, (p, proc) in out.items():
        _wait_ready(p, proc, name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3.5-0.8b", help="registry name or checkpoint folder")
    ap.add_argument("--format", default="f32", choices=list(QUANTIZE))
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=16384, help="llama-server's -c")
    ap.add_argument(
        "--warm",
        action="store_true",
        help="chatml's idle-time warm-up on (it then runs while llama-server answers)",
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="build parallelism")
    ap.add_argument("--work", help="build folder (default: CHATML_HOME/peer)")
    ap.add_argument("--json")
    a = ap.parse_args()

    import engine  # noqa: F401  (the fast BLAS, before mlx; conditions() reports it)
    from engine.paths import chatml_home

    work = Path(a.work).expanduser() if a.work else chatml_home() / "peer"
    src = llama_cpp(work, a.jobs)
    ckpt = model_path(a.model)
    gguf_path = gguf(src, work, ckpt, a.format)
    servers = _servers(a, ckpt, gguf_path, work)
    for port, _ in servers.values():  # first-request costs (allocations, compiles) out of turn 1
        ask(port, [{"role": "user", "content": "Warm-up."}], 4)
    history: dict[str, list[tuple[str, str]]] = {name: [] for name in servers}
    turns = []
    try:
        for i, user in enumerate(user_turns(a.turns)):
            order = list(servers) if i % 2 == 0 else list(reversed(servers))
            row = {"turn": i + 1}
            for name in order:
                kept = history[name][-WINDOW:]
                messages = [{"role": "system", "content": SYSTEM}]
                for u, assistant in kept:
                    messages += [{"role": "user", "content": u},
                                 {"role": "assistant", "content": assistant}]  # fmt: skip
                messages.append({"role": "user", "content": user})
                r = ask(servers[name][0], messages, a.max_tokens)
                history[name].append((user, r["text"]))
                row[name] = {k: r[k] for k in ("ttft_s", "total_s", "usage", "timings")}
            turns.append(row)
            c, ls = row["chatml"], row["llama-server"]
            print(f"turn {i + 1:>2}: ttft chatml {c['ttft_s'] * 1e3:7.0f} ms, llama-server "
                  f"{ls['ttft_s'] * 1e3:7.0f} ms ({c['ttft_s'] / ls['ttft_s']:.2f}x); prompt "
                  f"{(c['usage'] or {}).get('prompt_tokens')} tok", flush=True)  # fmt: skip
    finally:
        for _, proc in servers.values():
            proc.terminate()
        for _, proc in servers.values():
            proc.wait(timeout=60)
    ratio = [t["chatml"]["ttft_s"] / t["llama-server"]["ttft_s"] for t in turns]
    summary = {
        "ttft_sum_s": {n: sum(t[n]["ttft_s"] for t in turns) for n in servers},
        "ttft_ratio_median": median(ratio),
        "turns_chatml_sooner": sum(r < 1 for r in ratio),
    }
    print(f"sum of TTFT: chatml {summary['ttft_sum_s']['chatml']:.2f} s, llama-server "
          f"{summary['ttft_sum_s']['llama-server']:.2f} s; chatml sooner on "
          f"{summary['turns_chatml_sooner']} of {len(turns)} turns")  # fmt: skip
    result = {
        "conditions": conditions(model=a.model, checkpoint=str(ckpt), format=a.format,
                                 threads=a.threads, max_tokens=a.max_tokens,
                                 llama_cpp_python=LLAMA_CPP_PYTHON),
        "summary": summary, "turns": turns,
    }  # fmt: skip
    write_json(a.json, result)


if __name__ == "__main__":
    main()
