"""Constrained decoding: the answer must match a grammar (JSON Schema, any JSON object, a
regular expression or a Lark grammar), enforced as a link of the sampler's chain.

llguidance (a Rust library with Python bindings, no torch) compiles the grammar against the
model's tokenizer and, before each pick, computes the set of tokens that can continue a valid
answer; every other logit becomes -inf. Once the answer is complete only the stop token stays
allowed. The matcher lives on the host and advances by the tokens read, so a constrained row
decodes one step at a time (`reads_history`); the mask is computed while the model computes
the step's logits (`overlap`). Under speculative decoding a draft is cut at the first token
the matcher refuses (`allows`), and each verified position is masked for its own prefix:
the matcher takes the drafts one by one as the masks are computed, then rolls them back
(`draft`, `restore`); the tokens that stand are then accepted as plain decoding's are.

With a think block open (thinking mode) the constraint starts after `</think>`: the
reasoning is free, the answer is constrained (a JSON answer or a forced call may begin with up
to two newlines, as the template puts "\\n\\n" there; without a think block a JSON answer
begins at once). JSON answers are compact: no free whitespace to pad with.

llguidance's copy of the tokenizer is built once per process (seconds; `prepare` starts it
in the background). Compiled grammars are cached per grammar text and tokenizer; each answer
gets a copy of the compiled matcher (microseconds). `tool_call_spec` builds the grammar of a Qwen3.5
`<tool_call>` whose arguments match the tool's JSON Schema (forced tool calls).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from .sampling import LogitsProcessor

log = logging.getLogger(__name__)


class GrammarError(ValueError):
    """A constraint that cannot be compiled (bad schema, regex or grammar)."""


def grammar_text(spec: dict, after_think: bool = False) -> str:
    """llguidance's grammar for a constraint `spec`, one of:

    - ``{"type": "json_schema", "json_schema": {"schema": {...}}}`` (OpenAI's response_format;
      ``{"type": "json_schema", "schema": {...}}`` also accepted),
    - ``{"type": "json_object"}`` (any JSON object),
    - ``{"type": "regex", "regex": "..."}``, ``{"type": "lark", "lark": "..."}``.

    `after_think`: the answer follows a think block, where the template puts "\\n\\n": a JSON
    answer may begin with up to two newlines there (without one it begins at once).
    """
    return _grammar_text(json.dumps(spec, sort_keys=True), after_think)


@lru_cache(maxsize=256)
def _grammar_text(key: str, after_think: bool) -> str:
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
        lead = "/\\n{0,2}/ " if after_think else ""
        return _lark(f"start: {lead}answer\nanswer: %json {json.dumps(schema)}")
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


class _Build:
    """One llguidance tokenizer, built once: later callers wait on `done`."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value = None
        self.error: BaseException | None = None


_builds: dict[tuple, _Build] = {}
_builds_lock = threading.Lock()


def tokenizer_for(engine):
    """The engine's tokenizer as llguidance sees it, shared by every engine on the same
    tokenizer file. Built once per process (seconds): the first caller builds it, any other
    caller waits for that build (`prepare` starts it in the background at start-up)."""
    key = (str(Path(engine.path) / "tokenizer.json"), engine.model.arch.vocab_size,
           tuple(engine.stop_ids))  # fmt: skip
    with _builds_lock:
        build = _builds.get(key)
        mine = build is None
        if mine:
            build = _builds[key] = _Build()
    if mine:
        try:
            build.value = _make_tokenizer(engine.tokenizer, *key[1:])
        except BaseException as e:
            build.error = e
            with _builds_lock:
                del _builds[key]  # a later call tries again
        finally:
            build.done.set()
    build.done.wait()
    if build.error is not None:
        raise build.error
    return build.value


def prepare(engine) -> threading.Thread | None:
    """Start building `engine`'s llguidance tokenizer in a background thread (server start,
    `chatml chat --json*`), so that the first constrained request finds it ready; None if
    llguidance is not installed. The build holds the GIL while it runs (a few seconds)."""
    if importlib.util.find_spec("llguidance") is None:
        return None

    def build() -> None:
        try:
            tokenizer_for(engine)
        except Exception:  # the request that needs it raises it again (a fresh build)
            log.exception("building llguidance's tokenizer failed")

    # Not a daemon: the interpreter waits for it at exit. A daemon thread still inside the
    # build (native code) when the interpreter finalizes crashed it (SIGSEGV) in a server
    # stopped within a second of starting.
    thread = threading.Thread(target=build, name="llguidance-tokenizer", daemon=False)
    thread.start()
    return thread


def _make_tokenizer(tokenizer, vocab: int, eos: tuple[int, ...]):
    """llguidance's tokenizer over the engine's vocabulary.

    llguidance keeps every added token (`<tool_call>`, `</think>`...) apart from text, so the
    text it tokenizes (the bytes a grammar forces) must never become one either: it gets the
    tokenizer's BPE without the added-token split, where `</tool_call>` written in a JSON
    string is ordinary text (else it picks the `</tool_call>` token there, which its own
    matcher then rejects). No normalizer: llguidance needs tokens that decode to the bytes
    it asked for.
    """
    import llguidance

    backend = tokenizer.backend
    if type(backend.decoder).__name__ != "ByteLevel":  # not Qwen's byte-level BPE
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab, eos_token=list(eos))
    table = _byte_level_table()
    tokens = [b""] * vocab
    for text, i in backend.get_vocab(with_added_tokens=False).items():
        tokens[i] = text.translate(table).encode("latin-1")
    added = backend.get_added_tokens_decoder()
    for i, token in added.items():
        tokens[i] = token.content.encode()

    class Words:  # what llguidance.TokenizerWrapper reads
        eos_token_id, bos_token_id = eos[0], None
        special_token_ids = sorted(added)

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: str) -> list[int]:
            pieces = backend.pre_tokenizer.pre_tokenize_str(text)
            return [t.id for piece, _ in pieces for t in backend.model.tokenize(piece)]

    wrapper = llguidance.TokenizerWrapper(Words())
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab, eos_token=list(eos))


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[int, int]:
    """GPT-2's byte-level alphabet back to bytes: code point of each symbol -> the byte
    (as a latin-1 code point) it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    table = {b: b for b in printable}
    others = [b for b in range(256) if b not in table]
    table.update({256 + n: b for n, b in enumerate(others)})
    return table


@lru_cache(maxsize=64)
def _compiled(grammar: str, llt):
    """A fresh matcher for `grammar` (never advanced: callers take `deep_copy()`)."""
    import llguidance

    problem = llguidance.LLMatcher.validate_grammar(grammar, llt)
    if problem and not problem.startswith("WARNING"):
        raise GrammarError(f"invalid constraint: {problem}")
    matcher = llguidance.LLMatcher(llt, grammar, log_level=0)
    if not matcher.is_accepting() and not _can_start(matcher.deep_copy(), llt):
        # (else the answer would end at its first token, a failed generation: GrammarProcessor)
        raise GrammarError("no answer can match the constraint: it allows no first token")
    return matcher


def _can_start(matcher, llt) -> bool:
    """Whether the matcher allows a first token other than the end of the answer (a regex
    of an empty class allows only that). One mask, under a millisecond; cached with the
    compiled grammar."""
    allowed = np.flatnonzero(_allowed(matcher, llt.vocab_size))
    return not set(allowed.tolist()) <= set(llt.eos_tokens)


def _allowed(matcher, vocab_size: int) -> np.ndarray:
    """The matcher's mask for the next token: 1 where a token id may come next (`vocab_size`
    rounded up to whole 32-bit words)."""
    bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    return np.unpackbits(bits.view(np.uint8), bitorder="little")


def check(engine, spec: dict) -> None:
    """Raise GrammarError if `spec` cannot be compiled for `engine` (compiles and caches it)."""
    _compiled(grammar_text(spec), tokenizer_for(engine))


def tool_call_spec(tools: list[dict], open_id: int, close_id: int) -> dict:
    """A Lark constraint: one Qwen3.5 `<tool_call>` of one of `tools` (OpenAI function
    definitions), each declared parameter a compact JSON value valid against its schema,
    required ones always present, in the schema's order. String values are JSON strings
    (quoted), which `turn.parse_tool_calls` reads back exactly. `<tool_call>` and
    `</tool_call>` are single tokens (`open_id`, `close_id`), as the template writes them."""
    rules, calls = [], []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        # Each value's grammar is its property's schema alone: it carries the parameters'
        # definitions, which its `$ref`s ("#/$defs/X", pydantic's nested models) point into.
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        parts = []
        for j, (key, schema) in enumerate(props.items()):
            if isinstance(schema, dict):
                schema = {"x-guidance": {"whitespace_flexible": False}, **defs, **schema}
            rules.append(f"v{i}_{j}: %json {json.dumps(schema)}")
            head = json.dumps(f"<parameter={key}>\n")
            rules.append(f'p{i}_{j}: {head} v{i}_{j} "\\n</parameter>\\n"')
            parts.append(f"p{i}_{j}" + ("" if key in required else "?"))
        head = json.dumps(f"\n<function={fn['name']}>\n")
        tail = f'"</function>\\n" <[{close_id}]>'
        rules.append(f"call{i}: <[{open_id}]> {head} {' '.join(parts)} {tail}")
        calls.append(f"call{i}")
    lark = "\n".join([f"start: /\\n{{0,2}}/ ({' | '.join(calls)})", *rules])
    return {"type": "lark", "lark": lark}


class GrammarProcessor(LogitsProcessor):
    """Masks every token that cannot continue an answer matching `spec`. With `start_after`
    (`</think>`), the reasoning before it is free but cannot end the answer: the stop tokens
    stay masked until the constrained part has begun."""

    reads_history = True  # the matcher advances by the tokens read on the host
    speculates = True  # drafts go through the matcher and are rolled back (`draft`, `restore`)
    overlap = True  # queue the step's logits before computing the mask (bench/grammar.py)

    def __init__(self, engine, spec: dict, *, start_after: int | None = None):
        self.llt = tokenizer_for(engine)
        text = grammar_text(spec, after_think=start_after is not None)
        self.matcher = _compiled(text, self.llt).deep_copy()
        self.active = start_after is None  # else: waits for that token (`</think>`)
        self.start_after = start_after
        self.stops = frozenset(engine.stop_ids)
        self._masked_stops: mx.array | None = None  # `_stop_mask`
        self.drafted = 0  # draft tokens the matcher holds (`draft`), undone by `restore`

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        if not self.active:
            return mx.where(self._stop_mask(logits.shape[-1]), -mx.inf, logits)
        if self.overlap:  # the model computes this step while the host computes its mask
            mx.async_eval(logits)
        allowed = _allowed(self.matcher, self.llt.vocab_size)[: logits.shape[-1]]
        return mx.where(mx.array(allowed.astype(bool)), logits, -mx.inf)

    def _stop_mask(self, vocab: int) -> mx.array:
        """`[vocab]`, True at the stop tokens: made once, not at every step of the reasoning."""
        if self._masked_stops is None or self._masked_stops.shape[0] != vocab:
            mask = np.zeros(vocab, dtype=bool)
            mask[sorted(self.stops)] = True
            self._masked_stops = mx.array(mask)
        return self._masked_stops

    def accept(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if not self.active:
                self.active = t == self.start_after
                continue
            if t in self.stops and not self.matcher.is_accepting():
                # The matcher allows only a stop once nothing can continue: a constraint that
                # no answer can match (a regex of an empty class) would end the answer here.
                raise GrammarError("no answer can match the constraint: the answer so far "
                                   "cannot continue, and it does not match yet")  # fmt: skip
            if not self.matcher.consume_token(t):
                raise GrammarError(f"token {t} breaks the grammar: {self.matcher.get_error()}")

    def allows(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar could pick in turn (the matcher checks them
        without moving): a speculative draft is cut there."""
        free = 0
        if not self.active:  # free reasoning but no stop, up to and including `</think>`
            while free < len(tokens) and tokens[free] != self.start_after:
                if tokens[free] in self.stops:
                    return free
                free += 1
            if free == len(tokens):
                return free
            free += 1
        return free + self.matcher.validate_tokens(list(tokens[free:]))

    def draft(self, token: int) -> None:
        """Move the matcher as if `token` were picked, so the next verified position gets the
        mask for its own prefix. A stop token is not consumed (the answer ends there, and
        llguidance's rollback of one misses a token), nor one the grammar refuses (the
        matcher would never leave its error state): no draft after either can stand, so the
        masks after it are never read."""
        if not self.active:
            self.active = token == self.start_after
        elif token not in self.stops and self.matcher.try_consume_tokens([token]) == 1:
            self.drafted += 1

    def save(self) -> dict:
        return {"active": self.active, "drafted": self.drafted}

    def restore(self, state: dict) -> None:
        """Back to a `save`d point: the matcher rolls back the drafts taken since."""
        back = self.drafted - state["drafted"]
        if back and not self.matcher.rollback(back):
            raise GrammarError(
                f"rolling back {back} draft tokens failed: {self.matcher.get_error()}"
            )
        self.drafted, self.active = state["drafted"], state["active"]

    @property
    def complete(self) -> bool:
        """Whether what was accepted so far is a whole valid answer."""
        return self.active and self.matcher.is_accepting()
