"""Arrays that outlive a turn or a load are evaluated on the thread that made them.

MLX streams are per thread: evaluating a lazy array built on another thread's stream raises
"There is no Stream(cpu, N) in current thread" (and can abort the process at exit). So every
test here makes the state on one thread and uses it on another, in float32 and bfloat16.
"""

from __future__ import annotations

import threading

import pytest

from engine.runtime.sampling import Sampler, SamplingParams
from engine.runtime.sequence import CachedSequence, Progress
from engine.storage.state_file import capture_state, decode_state, state_key

PROMPT = "<|im_start|>user\nHello there, 你好!<|im_end|>\n<|im_start|>assistant\n"
MORE = "<|im_end|>\n<|im_start|>user\nAnd again?<|im_end|>\n<|im_start|>assistant\n"


def on_thread(fn):
    """Run `fn` on a new thread and return its result (or raise its exception here)."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed back to the test's thread
            out["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def generate(seq, ids, *, penalty=1.0, max_tokens=5):
    sampler = Sampler(SamplingParams(repetition_penalty=penalty))
    progress = Progress()
    tokens = list(seq.generate(ids, stops=[], sampler=sampler, max_tokens=max_tokens,
                               progress=progress, ignore_eos=True))  # fmt: skip
    return tokens


@pytest.fixture(params=["float32", "bfloat16"])
def eng(request, tiny, tiny_bf16):
    return tiny if request.param == "float32" else tiny_bf16


# penalty 1.0 decodes one step ahead; a repetition penalty decodes one step at a time
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_generate_on_one_thread_extend_and_generate_on_others(eng, penalty):
    ids = eng.tokenizer.encode(PROMPT)
    more = eng.tokenizer.encode(MORE)
    seq = CachedSequence(eng)
    answer = on_thread(lambda: generate(seq, ids, penalty=penalty))  # ends by length
    held = list(seq.tokens)
    assert held == ids + answer[:-1]  # continued from the live caches below, not a snapshot
    start, end = on_thread(lambda: seq.extend(held + more, stops=[]))
    assert (start, end) == (len(held), len(held) + len(more))
    # and a third thread decodes on from there: same tokens as the same ids in one piece
    got = on_thread(lambda: generate(seq, held + more, penalty=penalty))
    expected = generate(CachedSequence(eng), held + more, penalty=penalty)
    assert got == expected


def test_state_saved_and_loaded_on_other_threads(eng):
    ids = eng.tokenizer.encode(PROMPT)
    seq = CachedSequence(eng)
    on_thread(lambda: generate(seq, ids))
    data = on_thread(lambda: capture_state(seq, eng).encode())
    tokens, caches, snapshots = on_thread(lambda: decode_state(data, eng, state_key(seq.tokens)))
    assert tokens == seq.tokens
    more = tokens + eng.tokenizer.encode(MORE)
    restored = CachedSequence(eng)
    restored.load(tokens, caches, snapshots)
    got = on_thread(lambda: generate(restored, more))
    assert restored.tokens[: len(tokens)] == tokens
    assert got == generate(seq, more)
