"""What a turn's options ask of the sampler's chain: a response format or a forced tool call
(a grammar), a thinking budget, log-probabilities.

One place for the Python API (`Session`), `Engine.chat` and the server, so a constraint
means the same on every face. The grammar waits for `</think>` when the prompt opens a think
block; the thinking budget forces that `</think>` (engine/runtime/thinking.py).
"""

from __future__ import annotations

from .runtime.grammar import GrammarError, GrammarProcessor, check, tool_call_spec
from .runtime.sampling import Sampler, SamplingParams, processors_for
from .runtime.thinking import EFFORT_BUDGETS, ThinkingBudget

__all__ = ["GrammarError", "constraint_spec", "check_constraint", "make_sampler",
           "response_format_spec", "thinking_budget"]  # fmt: skip


def response_format_spec(fmt: object) -> dict | None:
    """OpenAI's `response_format` as a grammar spec (None for text); ValueError naming what
    is wrong. A spec of engine/runtime/grammar.py (regex, lark) is accepted as it is."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ValueError("response_format must be an object with a 'type'")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema"), (dict, bool)):
            raise ValueError("response_format.json_schema must be an object with a 'schema'")
        return {"type": "json_schema", "json_schema": {"schema": inner["schema"]}}
    if kind in ("regex", "lark"):
        if isinstance(fmt.get(kind), str):
            return {"type": kind, kind: fmt[kind]}
        raise ValueError(f"response_format.{kind} must be a string (the {kind} grammar the answer "
                         f"matches), got {fmt.get(kind)!r}")  # fmt: skip
    raise ValueError("response_format.type must be 'text', 'json_object', 'json_schema', "
                     f"'regex' or 'lark', got {kind!r}")  # fmt: skip


def thinking_budget(
    max_thinking_tokens: object = None, reasoning_effort: object = None
) -> int | None:
    """The budget of reasoning tokens (None: unbounded); `max_thinking_tokens` wins over
    OpenAI's `reasoning_effort` (low 512, medium 2048, high 8192). ValueError if bad."""
    if max_thinking_tokens is not None:
        n = max_thinking_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"max_thinking_tokens must be an integer >= 0, got {n!r}")
        return min(n, 2**31 - 1)  # counted in int32; no answer is that long
    if reasoning_effort is None:
        return None
    if reasoning_effort not in EFFORT_BUDGETS:
        raise ValueError(
            f"reasoning_effort must be one of {', '.join(EFFORT_BUDGETS)}, got {reasoning_effort!r}"
        )
    return EFFORT_BUDGETS[reasoning_effort]


def constraint_spec(engine, response_format: dict | None, forced_tools: list | None) -> dict | None:
    """The grammar a turn's answer must match: a forced tool call, else the response format."""
    if forced_tools:
        tok = engine.tokenizer
        return tool_call_spec(forced_tools, tok.token_id("<tool_call>"),
                              tok.token_id("</tool_call>"))  # fmt: skip
    return response_format


def check_constraint(engine, spec: dict | None) -> None:
    """GrammarError if `spec` does not compile (compiled grammars are cached: the turn's
    own compile is then free)."""
    if spec is not None:
        check(engine, spec)


def make_sampler(engine, params: SamplingParams, *, thinking: bool, spec: dict | None = None,
                 max_thinking_tokens: int | None = None,
                 top_logprobs: int | None = None) -> Sampler:  # fmt: skip
    """The turn's Sampler: penalties, thinking budget, grammar, then the pick. `thinking`:
    the prompt opens a think block (the budget counts from there, the grammar waits for its
    end). `top_logprobs` (0 to 20) records logprobs; None records none."""
    chain = processors_for(params)
    think_end = engine.tokenizer.token_id("</think>")
    if thinking and max_thinking_tokens is not None:
        chain.append(ThinkingBudget(max_thinking_tokens, think_end))
    if spec is not None:
        chain.append(GrammarProcessor(engine, spec, start_after=think_end if thinking else None))
    return Sampler(params, chain, top_logprobs=top_logprobs)
