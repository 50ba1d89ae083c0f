"""The session-38 run behind BENCHMARKS "n choices": four sampled answers to one ~600-token
prompt on the 0.8B through a live server, asked as one request with n=4 and as four n=1
requests sent at once (what a client did before n was accepted), alternating, each round on
a new salt so no request finds the prompt cached. `env -u OPENBLAS_CORETYPE -u
OPENBLAS_L2_SIZE python bench/results/n-choices-0.8b-session38.py` from the repository root."""

import threading
import time

import httpx

import engine
from bench.common import model_path
from bench.fork import document
from engine.serving.server import BackgroundServer, ServerConfig

N, TOKENS = 4, 16


def body(salt: int, **extra) -> dict:
    question = f"Case {salt}: which clause names the garden?"
    messages = [{"role": "user", "content": f"{question}\n\n{document(30)}"}]
    return {"model": "m", "messages": messages, "max_tokens": TOKENS, "temperature": 1.0,
            "seed": 1, **extra}  # fmt: skip


def one_request(url: str, salt: int) -> tuple[float, dict]:
    t = time.perf_counter()
    r = httpx.post(url, json=body(salt, n=N), timeout=600).json()
    return time.perf_counter() - t, r["usage"]


def parallel_requests(url: str, salt: int) -> tuple[float, dict]:
    out: list = [None] * N

    def send(i: int) -> None:
        out[i] = httpx.post(url, json=body(salt, seed=1 + i), timeout=600).json()["usage"]

    t = time.perf_counter()
    threads = [threading.Thread(target=send, args=(i,)) for i in range(N)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t, {"prompt_tokens": out[0]["prompt_tokens"],
                                     "cached": [u["prompt_tokens_details"]["cached_tokens"]
                                                for u in out]}  # fmt: skip


eng = engine.load(str(model_path("qwen3.5-0.8b")))
with BackgroundServer(eng, ServerConfig(port=0, warm=False, prepare_grammar=False)) as srv:
    url = srv.url + "/v1/chat/completions"
    for salt in range(6):
        how, run = (("n=4", one_request), ("4 x n=1", parallel_requests))[salt % 2]
        seconds, usage = run(url, salt)
        print(f"round {salt}: {how}: {seconds:.2f} s, {usage}", flush=True)
