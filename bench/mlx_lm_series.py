"""The mlx-lm side of the replay: stateless turns, the server's prompt cache, and mlx-lm as installed.

- `stock_turn`: ``mlx_lm.stream_generate`` on the full prompt with a fresh cache (what a
  stateless client of a stateless server costs).
- `PromptCache`: mlx-lm's ``LRUPromptCache`` driven the way ``mlx_lm.server`` drives it.
- `InstalledStock`: `stock_turn` in its own interpreter that never imports the engine, with
  ``CHATML_BLAS=0``: mlx-lm exactly as ``pip install mlx-lm`` gives it (on Linux the mlx-cpu
  wheel's reference BLAS, since the fast BLAS must be loaded before mlx to take effect). It
  serves one turn per request over a pipe, so the replay still runs the engines one after the
  other within each turn.

Nothing here imports the engine: the worker (``python -m bench.mlx_lm_series CHECKPOINT``)
must not load the fast BLAS.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, child_env, load_mlx_lm

PREFILL_STEP = 2048  # mlx-lm's default prefill_step_size (generate_step and the server)


def mask(banned: list[int]):
    """An mlx-lm logits processor that never samples `banned` ids (fixed decode length)."""
    import mlx.core as mx

    idx = mx.array(banned)

    def processor(tokens, logits):
        logits[:, idx] = -mx.inf
        return logits

    return processor


def _stream(model, tokenizer, prompt: list[int], cache, max_tokens: int, processor, t0: float):
    """Run mlx-lm's stream_generate; returns (ttft_s, decode_tps, generated ids)."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    first = last = None
    tokens: list[int] = []
    for r in stream_generate(
        model, tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(0.0),
        logits_processors=[processor], prompt_cache=cache, prefill_step_size=PREFILL_STEP,
    ):  # fmt: skip
        last = time.perf_counter()
        if first is None:
            first = last
        tokens.append(r.token)
    n = len(tokens)
    tps = (n - 1) / (last - first) if n > 1 and last > first else 0.0
    return first - t0, tps, tokens


def stock_turn(model, tokenizer, ids: list[int], max_tokens: int, processor) -> dict:
    """One stateless turn: the whole prompt prefilled into a fresh cache."""
    from mlx_lm.models.cache import make_prompt_cache

    t0 = time.perf_counter()
    cache = make_prompt_cache(model)
    ttft, tps, tokens = _stream(model, tokenizer, ids, cache, max_tokens, processor, t0)
    return {
        "reused_tokens": 0,
        "prefilled_tokens": len(ids),
        "ttft_s": ttft,
        "decode_tps": tps,
        "generated_tokens": len(tokens),
        "cache_bytes": sum(c.nbytes for c in cache),
    }


class PromptCache:
    """mlx-lm's server-side prompt cache, as `mlx_lm.server` uses it for chat requests.

    The server splits a chat prompt into segments (system prompt; the rest up to the think
    tail; the tail) and stores a cache copy in its `LRUPromptCache` at the end of each
    non-final segment and at the end of generation; each request starts from the nearest
    stored cache (Qwen3.5's recurrent layers cannot be trimmed, so only a stored prefix of
    the prompt can be reused). This drives the same calls without the HTTP layer; copies are
    `copy.deepcopy` as in `fetch_nearest_cache`.
    """

    KEY = "bench"

    def __init__(self, model, tokenizer, max_size: int = 10):
        from mlx_lm.models.cache import LRUPromptCache

        self.model, self.tokenizer = model, tokenizer
        self.lru = LRUPromptCache(max_size)

    def checkpoints(self, ids: list[int], system_end: int) -> list[tuple[int, str]]:
        """The server's segment ends before the last segment: (position, cache type)."""
        out = []
        if 0 < system_end < len(ids):
            out.append((system_end, "system"))
        tail = len(ids)
        if self.tokenizer.has_thinking:  # server._tokenize: a think tail of up to 11 tokens
            start = self.tokenizer.rfind_think_start(ids, start=len(ids) - 11)
            if start >= 0:
                tail = start
        if system_end < tail < len(ids):
            out.append((tail, "user"))
        return out

    def turn(self, ids: list[int], system_end: int, max_tokens: int, processor) -> dict:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        t0 = time.perf_counter()
        cache, rest = self.lru.fetch_nearest_cache(self.KEY, ids)
        reused = len(ids) - len(rest)
        if cache is None:
            cache = make_prompt_cache(self.model)
        pos = reused
        for end, kind in self.checkpoints(ids, system_end):
            if end <= pos:
                continue
            for a in range(pos, end, PREFILL_STEP):
                self.model(mx.array(ids[a : min(end, a + PREFILL_STEP)])[None], cache=cache)
                mx.eval([c.state for c in cache])
            self.lru.insert_cache(self.KEY, ids[:end], copy.deepcopy(cache), cache_type=kind)
            pos = end
        ttft, tps, tokens = _stream(
            self.model, self.tokenizer, ids[pos:], cache, max_tokens, processor, t0
        )
        # generate_step feeds every token it yields, so the cache holds prompt + answer.
        self.lru.insert_cache(self.KEY, ids + tokens, cache, cache_type="assistant")
        return {
            "reused_tokens": reused,
            "prefilled_tokens": len(ids) - reused,
            "ttft_s": ttft,
            "decode_tps": tps,
            "generated_tokens": len(tokens),
            "cache_bytes": self.lru.nbytes,
        }


def blas_libraries() -> list[str] | None:
    """The BLAS libraries mapped into this process (None where /proc cannot tell)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    paths = {line.split()[-1] for line in maps.read_text().splitlines() if "blas" in line.lower()}
    return sorted(p for p in paths if p.startswith("/"))


class InstalledStock:
    """`stock_turn` served by a child interpreter running mlx-lm as installed."""

    def __init__(self, path: str | Path, banned: list[int]):
        env = child_env("0")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.mlx_lm_series", str(path)],
            env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.hello = self._request({"banned": banned})

    def _request(self, message: dict) -> dict:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the mlx-lm stock worker exited (code {self.proc.wait()})")
        return json.loads(line)

    def turn(self, ids: list[int], max_tokens: int) -> dict:
        return self._request({"ids": ids, "max_tokens": max_tokens})

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()


def worker(path: str) -> None:
    """The child's loop: a hello with what it runs on, then one JSON row per request line."""
    import mlx.core as mx

    model, tokenizer = load_mlx_lm(path)
    processor = None
    for line in sys.stdin:
        request = json.loads(line)
        if "banned" in request:
            processor = mask(request["banned"])
            stock_turn(model, tokenizer, list(range(8)), 2, processor)  # first-call setup
            reply = {"mlx": mx.__version__, "blas_libraries": blas_libraries(),
                     "engine_imported": "engine" in sys.modules}  # fmt: skip
        else:
            reply = stock_turn(model, tokenizer, request["ids"], request["max_tokens"], processor)
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    worker(sys.argv[1])
