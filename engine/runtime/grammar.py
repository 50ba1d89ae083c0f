"""Constrained decoding: the answer must match a grammar (JSON Schema, any JSON object, a
regular expression or a Lark grammar), enforced as a link of the sampler's chain.

llguidance (a Rust library with Python bindings, no torch) compiles the grammar against the
model's tokenizer and, before each pick, computes the set of tokens that can continue a valid
answer; every other logit becomes -inf. Once the answer is complete only the stop token stays
allowed. The matcher lives on the host and advances by the tokens read, so a constrained row
decodes one step at a time (`reads_history`).

With a think block open (thinking mode) the constraint starts after `</think>`: the
reasoning is free, the answer is constrained (up to two leading newlines allowed, as the
template puts "\\n\\n" there). JSON answers are compact: no free whitespace to pad with.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from .sampling import LogitsProcessor


class GrammarError(ValueError):
    """A constraint that cannot be compiled (bad schema, regex or grammar)."""


def grammar_text(spec: dict) -> str:
    """llguidance's grammar for a constraint `spec`, one of:

    - ``{"type": "json_schema", "json_schema": {"schema": {...}}}`` (OpenAI's response_format;
      ``{"type": "json_schema", "schema": {...}}`` also accepted),
    - ``{"type": "json_object"}`` (any JSON object),
    - ``{"type": "regex", "regex": "..."}``, ``{"type": "lark", "lark": "..."}``.
    """
    return _grammar_text(json.dumps(spec, sort_keys=True))


@lru_cache(maxsize=256)
def _grammar_text(key: str) -> str:
    spec = json.loads(key)
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind in ("json_schema", "json_object"):
        if kind == "json_object":
            schema = {"type": "object"}
        else:
            inner = spec.get("json_schema", spec)
            schema = inner.get("schema") if isinstance(inner, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("a json_schema constraint needs a 'schema' object")
        if isinstance(schema, dict):  # compact JSON: no room for a model to pad with whitespace
            schema = {"x-guidance": {"whitespace_flexible": False}, **schema}
        # After a think block the template puts "\n\n" before the answer.
        return _lark(f"start: /\\n{{0,2}}/ answer\nanswer: %json {json.dumps(schema)}")
    if kind == "regex" and isinstance(spec.get("regex"), str):
        import llguidance

        return llguidance.LLMatcher.grammar_from_regex(spec["regex"])
    if kind == "lark" and isinstance(spec.get("lark"), str):
        return _lark(spec["lark"])
    raise GrammarError(
        f"unknown constraint {spec!r}: expected type json_schema, json_object, regex or lark"
    )


def _lark(text: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(text)


@lru_cache(maxsize=4)
def _tokenizer(path: str, vocab: int, eos: tuple[int, ...]):
    import llguidance

    return llguidance.LLTokenizer(path, n_vocab=vocab, eos_token=list(eos))


def tokenizer_for(engine):
    """The engine's tokenizer as llguidance sees it (built once per tokenizer file: seconds)."""
    path = str(Path(engine.path) / "tokenizer.json")
    return _tokenizer(path, engine.model.arch.vocab_size, tuple(engine.stop_ids))


class GrammarProcessor(LogitsProcessor):
    """Masks every token that cannot continue an answer matching `spec`."""

    reads_history = True  # the matcher advances by the tokens read on the host

    def __init__(self, engine, spec: dict, *, start_after: int | None = None):
        import llguidance

        self.llt = tokenizer_for(engine)
        grammar = grammar_text(spec)
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.llt)
        if problem and not problem.startswith("WARNING"):
            raise GrammarError(f"invalid constraint: {problem}")
        self.matcher = llguidance.LLMatcher(self.llt, grammar, log_level=0)
        self.active = start_after is None  # else: waits for that token (`</think>`)
        self.start_after = start_after
        self._words = (self.llt.vocab_size + 31) // 32

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        if not self.active:
            return logits
        bits = np.zeros(self._words, dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[: logits.shape[-1]]
        return mx.where(mx.array(allowed.astype(bool)), logits, -mx.inf)

    def accept(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if not self.active:
                self.active = t == self.start_after
                continue
            if not self.matcher.consume_token(t):
                raise GrammarError(f"token {t} breaks the grammar: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """Whether what was accepted so far is a whole valid answer."""
        return self.active and self.matcher.is_accepting()
