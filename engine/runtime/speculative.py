"""Speculative decoding: a drafter proposes k tokens, one step verifies all k+1 positions.

The step (`step.forward`) feeds the pending token and the k drafts in one pass, keeping the
per-position states; the verifier decides how many drafts stand (greedy: the longest prefix
the model's argmax agrees with; sampling: the speculative sampling rule, so the output keeps
the target's distribution), and `step.rollback` trims the KV caches and restores the Gated
DeltaNet conv and recurrent states to the last token that stands. Nothing is re-prefilled.

Greedy output is token-for-token the plain loop's (`generate.decode`), penalties and
grammars included: each verified position is processed as if the drafts before it had been
picked (a presence or repetition penalty counts them, a grammar's matcher takes them and
masks that position for its own prefix, then rolls back), and the processors then advance
by the tokens that stood (`Sampler.process_drafts`, `Sampler.stood`). A draft is cut at the
first token a grammar refuses (`Sampler.allowed`): no verify position is spent on it.
Logprobs of the tokens that stand come from the verify step's logits at their positions
(`Sampler.record`), the logits plain decoding would have picked them after.

`DraftLength` picks k from the measured cost of drafting and verifying and the acceptance
seen so far, and switches drafting off (the plain pipelined loop runs, with probes at
growing intervals) when it does not pay.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx

from .generate import decode_steps, run_loop
from .sampling import Sampler
from .step import Row, rollback


class Drafter(Protocol):
    """Proposes up to `k` tokens to follow `history` (the prompt and the answer so far).

    One drafter serves one answer: `history` only grows between calls."""

    def propose(self, history: Sequence[int], k: int) -> list[int]: ...


class LookupDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the history's
    last n-gram (longest n first). No weights; pays off where answers quote their context.

    The n-grams are indexed incrementally, so a proposal costs O(new tokens), not O(history).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> its latest start with a follower
        self.indexed = 0  # n-grams ending before this position are indexed

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        L = len(history)
        for end in range(self.indexed + 1, L):  # an n-gram ending at `end` has a follower
            for n in self.sizes:
                if end >= n:
                    self.index[tuple(history[end - n : end])] = end - n
        self.indexed = max(self.indexed, L - 1)
        for n in self.sizes:
            if L > n and (start := self.index.get(tuple(history[L - n :]))) is not None:
                return list(history[start + n : start + n + k])
        return []


class InjectedDrafter:
    """For tests and benchmarks: proposes the target's own greedy continuation `truth` of
    `prompt_len` prompt tokens, each draft token wrong with probability `reject_rate` (seeded),
    so every acceptance length happens at a known rate."""

    def __init__(self, truth: Sequence[int], prompt_len: int, reject_rate: float, seed: int = 0):
        self.truth, self.prompt_len, self.rate = list(truth), prompt_len, reject_rate
        self.rng = random.Random(seed)

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        at = len(history) - self.prompt_len
        if history[self.prompt_len :] != self.truth[:at]:
            return []  # off the script (an injected token was accepted by a sampler)
        out = []
        for t in self.truth[at : at + k]:
            out.append((t + 1) % 1000 if self.rng.random() < self.rate else t)
        return out


@dataclass
class SpeculationStats:
    """What drafting did in one answer."""

    drafted: int = 0  # draft tokens proposed to the model
    accepted: int = 0  # of those, how many stood
    verifies: int = 0  # verify steps run
    verify_tokens: int = 0  # tokens those steps produced (accepted drafts + one of the model's)
    cut: int = 0  # proposed tokens dropped before verifying (from the first a grammar refused)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verify(self) -> float:
        return self.verify_tokens / self.verifies if self.verifies else 0.0


class DraftLength:
    """How many tokens to draft next: k that maximises expected tokens per second.

    With acceptance a per draft token (a decayed count of hits over tries), k drafts yield
    1 + a + ... + a^k tokens per verify, which costs about `plain_s + per_draft_s * k` (both
    measured, decayed). When plain decoding wins (k = 0) the loop decodes plainly for
    `cooloff` tokens, then probes with one verify; each probe that still loses doubles the
    cooloff (up to `max_cooloff`), so a drafter that never pays costs a few percent at most.
    `adaptive=False` always drafts `max_k` (tests, benchmarks).
    """

    def __init__(self, max_k: int, *, adaptive: bool = True, cooloff: int = 16,
                 max_cooloff: int = 256, decay: float = 0.9):  # fmt: skip
        if max_k < 1:
            raise ValueError(f"num_draft must be >= 1, got {max_k}")
        self.max_k, self.adaptive, self.decay = max_k, adaptive, decay
        self.base_cooloff, self.max_cooloff = cooloff, max_cooloff
        self.cooloff = cooloff
        self.hits, self.tries = 1.0, 1.0  # optimistic prior: draft first, then learn
        self.plain_s: float | None = None
        self.per_draft_s: float | None = None
        self.verifies = 0
        self.probing = False

    def next(self) -> int:
        """Drafts for the next step; 0 means decode `plain_tokens()` tokens plainly."""
        if not self.adaptive:
            return self.max_k
        if self.plain_s is None:
            return self.max_k if self.verifies < 2 else 0  # measure plain decoding once
        best = self.best()
        if best == 0 and self.probing:
            self.probing = False
            return 1  # one probe after a cooloff: fresh evidence for `best`
        return best

    def best(self) -> int:
        a = self.hits / self.tries
        rates = [sum(a**i for i in range(k + 1)) / (self.plain_s + (self.per_draft_s or 0.0) * k)
                 for k in range(self.max_k + 1)]  # fmt: skip
        return max(range(self.max_k + 1), key=rates.__getitem__)

    def plain_tokens(self) -> int:
        return self.cooloff if self.adaptive else 1

    def after_empty(self) -> int:
        """Plain tokens after the drafter had nothing: a short pipelined run (a lookup that
        finds no match would otherwise cost every step its overlap with the next)."""
        return 4 if self.adaptive else 1

    def record_verify(self, k: int, n: int, seconds: float) -> None:
        self.verifies += 1
        d = self.decay
        self.hits = d * self.hits + n
        self.tries = d * self.tries + n + (n < k)
        if self.plain_s is not None:
            per = max(0.0, (seconds - self.plain_s) / k)
            old = self.per_draft_s
            self.per_draft_s = per if old is None else d * old + (1 - d) * per
        if self.plain_s is not None and self.best() > 0:
            self.cooloff = self.base_cooloff  # drafting pays again

    def record_plain(self, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return
        s = seconds / tokens
        self.plain_s = (
            s if self.plain_s is None else self.decay * self.plain_s + (1 - self.decay) * s
        )
        if tokens >= self.cooloff:  # a whole cooloff ran: probe next, and wait longer after
            self.probing = True
            self.cooloff = min(2 * self.cooloff, self.max_cooloff)


@dataclass
class Speculation:
    """An engine's speculative decoding setup: which drafter, how many drafts at most."""

    drafter: Callable[[], Drafter] = LookupDrafter
    num_draft: int = 4
    adaptive: bool = True
    policy: DraftLength = field(init=False)  # engine-wide: its timings carry across answers

    def __post_init__(self):
        self.policy = DraftLength(self.num_draft, adaptive=self.adaptive)

    @staticmethod
    def applies(sampler: Sampler) -> bool:
        """Whether `sampler` can verify drafts: every processor can process them
        (`LogitsProcessor.speculates`). Penalties, a thinking budget, a grammar and logprobs
        all verify exactly; a custom processor that reads the host's tokens may not."""
        return all(p.speculates for p in sampler.processors)


def verify(sampler: Sampler, logits: mx.array, drafts: Sequence[int],
           history: Sequence[int] = ()) -> tuple[list, list]:  # fmt: skip
    """(accept, fallback) for `drafts` from the step's logits `[k+1, V]`, after `history`.

    Each position's logits go through the sampler's processors as if the drafts before it
    had been picked (`Sampler.process_drafts`). `accept[i]`: draft i stands if all before it
    do; `fallback[i]`: the model's token at position i when draft i is rejected
    (`fallback[k]`: the token after all k). Greedy: the argmax. Sampling, for a deterministic
    drafter: draft d stands with probability p(d), else the token is drawn from p with d
    removed and renormalised; the emitted tokens then follow the target's distribution
    exactly (Leviathan et al. 2023; Chen et al. 2023). A seeded sampler draws each position's
    token as plain decoding would, with the next key of its chain (a draft stands when it is
    that token: again with probability p(d)), and `Sampler.stood` keeps the keys of the
    tokens that stood: a seed gives the same answer with drafting as without, whichever
    steps verify.
    """
    k = len(drafts)
    processed = sampler.process_drafts(logits, drafts, history)  # [k+1, V] float32
    if sampler.p.temperature == 0:
        fallback = mx.argmax(processed, axis=-1)
        fallback = fallback.tolist()
        return [fallback[i] == drafts[i] for i in range(k)], fallback
    if sampler.key is not None:  # seeded: each position drawn as plain decoding draws it
        fallback = sampler.draws(processed).tolist()
        return [fallback[i] == drafts[i] for i in range(k)], fallback
    key_u, key_c = sampler.subkey(), sampler.subkey()
    p_draft, fallback = sampler.residual(processed, drafts, key_c)
    ok = mx.random.uniform(shape=(k,), key=key_u) < p_draft
    mx.eval(ok, fallback)
    return ok.tolist(), fallback.tolist()


def speculative_decode(
    model,
    caches: list,
    logits: mx.array,
    sampler: Sampler,
    *,
    max_tokens: int,
    stop_ids: Sequence[int],
    history: list[int],
    drafter: Drafter,
    policy: DraftLength,
    stats: SpeculationStats,
    batch=None,
) -> Iterator[int]:
    """`generate.decode`'s contract, drafting: yields each token (the stop token too, never
    fed); a token at which the consumer stops is not fed; `history` grows in place; on every
    way out the caches hold every yielded token but the last, evaluated on this thread.

    With a `batch.Batch`, its verify rows and plain steps run in the batch's passes with the
    other rows (yielding `WAIT` while they wait), as `Batch.decode`'s steps do; else at once."""
    steps = speculate_steps(model, caches, logits, sampler, max_tokens, set(stop_ids), history,
                            drafter, policy, stats)  # fmt: skip
    if batch is not None:
        return batch.loop(steps, caches, sampler)
    return run_loop(model, steps, caches, sampler)


def speculate_steps(model, caches, logits, sampler, max_tokens, stops, history, drafter,
                    policy, stats) -> Generator:  # fmt: skip
    """The speculative loop as a step coroutine (see `generate.decode_steps`): it yields a
    `Row` when it needs a pass, verify rows included, and each token as it is read."""
    if hasattr(drafter, "bind"):  # a drafter that reads the sequence's caches (MTP)
        drafter.bind(model, caches)
    start = len(history)
    token = sampler(logits, history).item()
    history.append(token)
    sampler.accept((token,))
    yield token
    while token not in stops and (made := len(history) - start) < max_tokens:
        # `token` is read and not fed; every token before it is in the caches.
        room = max_tokens - made
        k = min(policy.next(), room - 1)
        t = time.perf_counter()  # drafting counts in a verify's cost (MTP: k head steps)
        drafts = drafter.propose(history, k) if k > 0 else []
        allowed = sampler.allowed(drafts)  # a grammar cuts what it would refuse
        stats.cut += len(drafts) - allowed
        drafts = drafts[:allowed]
        if not drafts:  # the plain loop (pipelined) for a while, or one step
            m = min(room, policy.plain_tokens() if k == 0 else policy.after_empty())
            step_logits, _, _ = yield Row(caches, [token])
            # Closed at one of its tokens, it undoes its step ahead (`decode_steps`).
            yield from decode_steps(caches, step_logits[-1], sampler, max_tokens=m,
                                    stop_ids=tuple(stops), history=history)  # fmt: skip
            token = history[-1]
            policy.record_plain(m, time.perf_counter() - t)
            continue
        k = len(drafts)
        step_logits, mark, _ = yield Row(caches, [token, *drafts], logits=k + 1,
                                         keep=range(1, k + 1))  # fmt: skip
        accept, fallback = verify(sampler, step_logits, drafts, history)
        n = 0
        while n < k and accept[n]:
            n += 1
            if drafts[n - 1] in stops:
                break
        stopped = n > 0 and drafts[n - 1] in stops
        standing = drafts[:n] if stopped else [*drafts[:n], fallback[n]]
        # Fed: the pending token and the drafts that stand (a stop draft is not fed).
        rollback(caches, mark, mark.start + n + (0 if stopped else 1))
        policy.record_verify(k, n, time.perf_counter() - t)
        sampler.stood(standing)
        sampler.record(step_logits, standing)  # logprobs: token i was picked after row i
        stats.drafted += k
        stats.accepted += n
        stats.verifies += 1
        stats.verify_tokens += len(standing)
        for i, token in enumerate(standing):
            history.append(token)
            sampler.accept((token,))
            try:
                yield token
            except GeneratorExit:  # not fed: back to just before this token
                if i < n:
                    rollback(caches, mark, mark.start + 1 + i)
                raise
