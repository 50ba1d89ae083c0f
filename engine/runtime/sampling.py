"""Token sampling: a chain of logits processors, then the pick.

A row's chain runs in one fixed order: the logit bias, the penalties (repetition, then
presence and frequency), then a thinking budget, then the grammar mask (constrained
decoding), then the pick (greedy, or temperature with top-k, top-p, min-p and a seeded key).
Rows decoding in one batched step are picked together (`pick_rows`): each row's chain on its
own logits, then
one pick per group of rows that share their cuts, each row drawing at a uniform from its own
key, so a row's tokens are those it would draw alone. A draw is the inverse CDF over the cut
distribution in index order, on the CPU one native pass, elsewhere MLX's ops (`draw`).

Log-probabilities reported to callers (`Sampler(..., top_logprobs=k)`, `Turn.logprobs`) are
those of the model's distribution: log_softmax of the raw logits, before penalties, masks,
temperature and cuts, as OpenAI reports them (a token the grammar forced keeps the
probability the model gave it).

Processors keep their state on the device where they can: the penalties count tokens in MLX
arrays that each pick updates lazily (`advance`), so decoding still runs a step ahead of the
host with them. They rebind those arrays and never write into them, so a state is saved and
restored by reference (`save`/`restore`): speculative decoding processes each verified
position as if the drafts before it had been picked, then keeps only the picks that stood
(`Sampler.process_drafts`, `Sampler.stood`). A processor that needs the tokens read on the
host (a grammar matcher that advances by accepted tokens) says so with `reads_history`:
decoding then runs one step at a time (see `generate.decode`). It can still verify drafts:
it takes each draft on the host as if picked (`draft`) and rolls back after (`restore`), so
each verified position is masked for its own prefix, and `allows` says where a draft stops
being one it could ever pick (the draft is cut there, before verifying).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from kernels.choice import device_kind
from kernels.sampling import logprobs, sample, sample_excluding, sample_rows

MAX_SEED = 2**64 - 1  # mx.random.key takes an unsigned 64-bit seed
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: -100 bans a token, 100 all but forces it
# A temperature below this picks greedily (as vLLM's _SAMPLING_EPS): dividing float32 logits
# by less overflows to inf, and the draw is the argmax's anyway.
GREEDY_BELOW = 1e-5
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)
_FLOAT32_BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. The defaults are plain greedy decoding (the Python API's default).

    `presence_penalty` and `frequency_penalty` follow OpenAI: a token already generated in
    this answer has its logit lowered by `presence_penalty` once plus `frequency_penalty`
    times its count (the prompt does not count). `repetition_penalty` (divide positive
    logits, multiply negative ones) looks at the last `repetition_window` tokens, prompt
    included.
    """

    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 keeps all
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_window: int = 64  # how many recent tokens the penalty looks at
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI's: once per token already in the answer
    frequency_penalty: float = 0.0  # OpenAI's: times the token's count in the answer
    # OpenAI's `logit_bias`: {token id: bias in [-100, 100]} added to the model's logits before
    # everything else (kept as sorted (id, bias) pairs, so the params stay hashable)
    logit_bias: tuple = ()

    def check_vocabulary(self, size: int) -> None:
        """ValueError if `logit_bias` names a token id past a vocabulary of `size` tokens."""
        _check_ids(self.logit_bias, size, f"the vocabulary ({size} tokens)")

    def __post_init__(self):
        problems = []
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty")  # fmt: skip
        bad_type = [n for n in floats if not _is_number(getattr(self, n))]
        for name in bad_type:
            problems.append(f"{name} must be a number, got {getattr(self, name)!r}")
        ok = set(floats) - set(bad_type)
        # Written so that NaN fails every check (each comparison with NaN is false).
        t = self.temperature
        if "temperature" in ok and (not t >= 0 or t == float("inf")):
            problems.append(f"temperature must be >= 0 and finite, got {t}")
        if "top_p" in ok and not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            problems.append(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if "min_p" in ok and not 0 <= self.min_p < 1:
            problems.append(f"min_p must be in [0, 1), got {self.min_p}")
        r = self.repetition_penalty
        if "repetition_penalty" in ok and not 0 < r < float("inf"):
            problems.append(f"repetition_penalty must be > 0 and finite, got {r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if name in ok and not -2 <= getattr(self, name) <= 2:
                problems.append(f"{name} must be between -2 and 2, got {getattr(self, name)}")
        w = self.repetition_window
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            problems.append(f"repetition_window must be an integer >= 1, got {w!r}")
        bias = () if self.logit_bias is None else self.logit_bias
        pairs = list(bias.items()) if isinstance(bias, dict) else None
        if isinstance(bias, (tuple, list)) and all(
            isinstance(pair, (tuple, list)) and len(pair) == 2 for pair in bias
        ):
            pairs = [tuple(pair) for pair in bias]
        if pairs is None:
            problems.append(f"logit_bias must map token ids to biases, got {bias!r}")
        else:
            for token, b in pairs:
                if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                    problems.append(f"logit_bias token ids are integers >= 0, got {token!r}")
                elif not _is_number(b) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                    problems.append(f"logit_bias amounts are numbers from -100 to 100, got "
                                    f"{b!r} for token {token}")  # fmt: skip
            if len({token for token, _ in pairs}) != len(pairs):
                problems.append("logit_bias names a token twice")
        s = self.seed
        if s is not None and (
            not isinstance(s, int) or isinstance(s, bool) or not 0 <= s <= MAX_SEED
        ):
            problems.append(f"seed must be an integer from 0 to 2**64-1, got {s!r}")
        if problems:
            raise ValueError("; ".join(problems))
        # Valid values that the float32/int32 samplers would take differently, taken as the
        # nearest ones that draw the same: a temperature too small to divide by is greedy; a
        # top_p below float32's range keeps the top token, as does a min_p that rounds to 1;
        # a top_k past int32 keeps all (it exceeds any vocabulary).
        if 0 < t < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        object.__setattr__(self, "top_p", max(self.top_p, _FLOAT32_TINY))
        object.__setattr__(self, "min_p", min(self.min_p, _FLOAT32_BELOW_ONE))
        if self.top_k >= 2**31:
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in sorted(pairs)))


def token_logprobs(logits: mx.array, tokens: mx.array, k: int
                   ) -> tuple[mx.array, mx.array, mx.array]:  # fmt: skip
    """log_softmax of float32 `logits` `[..., V]` at `tokens` `[...]`, and the `k` most likely
    ids `[..., k]` with their values (in no set order): on the CPU one native pass, else MLX's
    ops (a partition, linear in V)."""
    entry = logprobs(logits, tokens, k)
    if entry is not None:
        return entry
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens[..., None].astype(mx.int32), axis=-1)[..., 0]
    if not k:
        top = mx.zeros((*lp.shape[:-1], 0), dtype=mx.uint32)
        return chosen, top, lp[..., :0]
    top = mx.argpartition(-lp, k - 1, axis=-1)[..., :k]
    return chosen, top, mx.take_along_axis(lp, top, axis=-1)


@dataclass
class TokenLogprob:
    """One generated token's log-probability under the model, and the `top` most likely
    alternatives as (token id, logprob), most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


MAX_TOP_LOGPROBS = 20  # as the OpenAI API


class LogitsProcessor:
    """One link of the chain: float32 logits `[V]` in, processed logits `[V]` out.

    `advance(token)` gets every pick, as a (maybe still lazy) scalar array, before the next
    call: state kept in MLX arrays follows the answer without waiting for the host.
    `accept(tokens)` gets the tokens read on the host; a processor that needs them before the
    next pick sets `reads_history`.
    """

    reads_history = False

    @property
    def speculates(self) -> bool:
        """Whether a verify step can process drafts through this processor: one with device
        state does (`advance`, `save`, `restore`); one that reads the host's tokens does only
        if it also takes drafts on the host and undoes them (`draft`, `restore`: a grammar)."""
        return not self.reads_history

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        raise NotImplementedError

    def advance(self, token: mx.array) -> None:
        """The last pick (device side)."""

    def accept(self, tokens: Sequence[int]) -> None:
        """Tokens that stood, read on the host (a grammar matcher advances here)."""

    def allows(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` could be picked in turn from here (a grammar's matcher
        checks them); a draft past that could never stand."""
        return len(tokens)

    def draft(self, token: int) -> None:
        """Host side of a draft taken as if picked (`Sampler.process_drafts`, which restores
        the processor after); `advance` gets the same token on the device side."""

    def save(self) -> dict:
        """The device-side state, by reference (processors rebind their arrays, never write
        into them; one that keeps host state it mutates sets `reads_history`)."""
        return dict(vars(self))

    def restore(self, state: dict) -> None:
        vars(self).update(state)


class RepetitionPenalty(LogitsProcessor):
    """Divide positive (multiply negative) logits of the last `window` tokens by `penalty`.

    The window (prompt included) is a device-side ring of token ids, seeded from the history
    at the first call and pushed by each pick. Only the window's logits are read and written
    (a gather and a scatter of `window` values), not the whole vocabulary.
    """

    def __init__(self, penalty: float, window: int):
        self.penalty, self.window = penalty, window
        self.recent: mx.array | None = None  # [window] ids, newest last; -1 marks an empty slot
        self.filled = 0  # slots holding a token (known on the host)

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        if self.recent is None:
            tail = list(history[-self.window :])
            self.recent = mx.array([-1] * (self.window - len(tail)) + tail, dtype=mx.int32)
            self.filled = len(tail)
        if not self.filled:
            return logits
        # Empty slots point at the newest token: every write to one id is then the same value.
        ids = mx.where(self.recent >= 0, self.recent, self.recent[-1])
        seen = logits[ids]
        out = mx.array(logits)  # its own array: the caller's logits stay as they are
        out[ids] = mx.where(seen > 0, seen / self.penalty, seen * self.penalty)
        return out

    def advance(self, token: mx.array) -> None:
        if self.recent is not None:
            self.recent = mx.concatenate([self.recent[1:], token.reshape(1).astype(mx.int32)])
            self.filled = min(self.window, self.filled + 1)


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's penalties over the answer so far (not the prompt): a token's logit drops by
    `presence` once it has appeared and by `frequency` times its count. The counts live on
    the device, pushed by each pick."""

    def __init__(self, presence: float, frequency: float):
        self.presence, self.frequency = presence, frequency
        self.counts: mx.array | None = None  # [V] float32

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        if self.counts is None:
            self.counts = mx.zeros(logits.shape, dtype=mx.float32)
        c = self.counts
        return logits - self.frequency * c - self.presence * (c > 0).astype(mx.float32)

    def advance(self, token: mx.array) -> None:
        if self.counts is not None:
            self.counts = self.counts.at[token.reshape(1)].add(1.0)


class LogitBias(LogitsProcessor):
    """OpenAI's `logit_bias`: fixed amounts added to some tokens' logits (a dense `[V]` vector
    made at the first call, then one add a pick)."""

    def __init__(self, pairs: Sequence[tuple[int, float]]):
        self.pairs = tuple(pairs)
        self.bias: mx.array | None = None

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        V = logits.shape[-1]
        if self.bias is None or self.bias.shape[0] != V:
            _check_ids(self.pairs, V, f"the model's {V} logits")
            bias = np.zeros(V, np.float32)
            for token, b in self.pairs:
                bias[token] = b
            self.bias = mx.array(bias)
        return logits + self.bias


def _check_ids(pairs: tuple, size: int, what: str) -> None:
    """ValueError if sorted (id, bias) `pairs` name an id of `size` or more."""
    if pairs and pairs[-1][0] >= size:  # sorted by id: the last is the largest
        raise ValueError(f"logit_bias names token {pairs[-1][0]}, past {what}")


def processors_for(params: SamplingParams) -> list[LogitsProcessor]:
    """The processors `params` asks for, in the chain's order."""
    chain: list[LogitsProcessor] = []
    if params.logit_bias:
        chain.append(LogitBias(params.logit_bias))
    if params.repetition_penalty != 1.0:
        chain.append(RepetitionPenalty(params.repetition_penalty, params.repetition_window))
    if params.presence_penalty or params.frequency_penalty:
        chain.append(PresenceFrequencyPenalty(params.presence_penalty, params.frequency_penalty))
    return chain


class Sampler:
    """A row's chain: `processors` (default: those `params` asks for), then the pick.

    `sampler(logits, history)` returns the next token as a (lazy) scalar array; it owns the
    row's random key, so a seeded row draws the same tokens whatever else runs. One Sampler
    serves one answer: each call's pick is passed to the processors' `advance` before the
    next call.
    """

    def __init__(self, params: SamplingParams, processors: list[LogitsProcessor] | None = None,
                 *, top_logprobs: int | None = None):  # fmt: skip
        self.p = params
        self.processors = processors_for(params) if processors is None else processors
        self.key = mx.random.key(params.seed) if params.seed is not None else None
        self._last: mx.array | None = None  # the previous pick, not yet advanced
        # A seeded verify step's keys: the key after each position's draw (`draws`, `stood`).
        self._drawn: list[mx.array] = []
        # With `top_logprobs` (0 to 20) every pick's logprob is recorded:
        # `recorded` those of the tokens read (`accept`), `_pending` those still on the device.
        self.top_logprobs = top_logprobs
        self.recorded: list[TokenLogprob] = []
        self._pending: list[tuple] = []

    @property
    def reads_history(self) -> bool:
        """Whether a pick depends on the tokens before it (then decoding cannot run ahead)."""
        return any(p.reads_history for p in self.processors)

    def __call__(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        return self.sample(logits, history)[0]

    def sample(self, logits: mx.array, history: Sequence[int]) -> tuple[mx.array, mx.array]:
        """(the pick, the processed logits it was picked from: see `logprobs`)."""
        processed = self.begin(logits, history)
        pick = self.pick(processed)
        self.end(logits, pick)
        return pick, processed

    def begin(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        """A pick's first half: the previous pick to the processors, then this row's logits
        through them. Processors' calls change nothing, so a pick that fails before `end`
        can be made again."""
        self._advance()
        return self.process(logits, history)

    def end(self, logits: mx.array, pick: mx.array) -> None:
        """A pick's second half: `pick` (from the raw `logits`) becomes the last one."""
        self._last = pick
        if self.top_logprobs is not None:
            self._record(logits, pick)

    @property
    def cuts(self) -> tuple:
        """What the pick does with processed logits: rows with equal cuts are picked in one
        call (`pick_rows`)."""
        p = self.p
        return (0.0,) if p.temperature == 0 else (p.temperature, p.top_k, p.top_p, p.min_p)

    def _advance(self) -> None:
        """Pass the previous pick to the processors (each waits until the next is needed)."""
        if self._last is not None:
            for p in self.processors:
                p.advance(self._last)
            self._last = None

    def process_drafts(self, logits: mx.array, drafts: Sequence[int], history: Sequence[int]
                       ) -> mx.array:  # fmt: skip
        """A verify step's logits `[k+1, V]` through the processors: row i as plain decoding
        would process it had `drafts[:i]` been picked (penalties count them). The processors
        end as they began; `stood` then advances them by the picks that stand."""
        self._advance()
        if not self.processors:
            return logits.astype(mx.float32)
        saved = [p.save() for p in self.processors]
        rows = []
        for i in range(len(drafts) + 1):
            rows.append(self.process(logits[i], [*history, *drafts[:i]]))
            if i < len(drafts):
                pick = mx.array(drafts[i], dtype=mx.uint32)  # as mx.argmax's picks are
                for p in self.processors:
                    p.advance(pick)
                    p.draft(drafts[i])
        for p, state in zip(self.processors, saved):
            p.restore(state)
        return mx.stack(rows)

    def allowed(self, drafts: Sequence[int]) -> int:
        """How many leading `drafts` every processor allows (`LogitsProcessor.allows`): the
        drafts worth verifying."""
        n = len(drafts)
        for p in self.processors:
            n = min(n, p.allows(drafts[:n]))
        return n

    def stood(self, tokens: Sequence[int]) -> None:
        """The tokens a verify step emitted, in order: the processors advance by each but the
        last, which waits for the next pick as `sample`'s own picks do."""
        self._advance()
        for token in tokens[:-1]:
            pick = mx.array(token, dtype=mx.uint32)
            for p in self.processors:
                p.advance(pick)
        if tokens:
            self._last = mx.array(tokens[-1], dtype=mx.uint32)
        if self._drawn and tokens:  # a seeded verify drew every position: keep those used
            self.key = self._drawn[len(tokens) - 1]
        self._drawn = []

    def record(self, logits: mx.array, tokens: Sequence[int]) -> None:
        """Queue the logprobs of `tokens` a verify step emitted (with `top_logprobs`), token
        i picked after the model's raw logits `logits[i]`: as `sample` queues its picks',
        each read back by `accept`."""
        if self.top_logprobs is not None:
            for i, token in enumerate(tokens):
                self._record(logits[i], mx.array(token, dtype=mx.uint32))

    def _record(self, logits: mx.array, token: mx.array) -> None:
        """Queue the model's logprob of `token` and the top alternatives (with the pick's
        own evaluation, so reading them later does not wait on the next step)."""
        raw = logits.astype(mx.float32)
        entry = token_logprobs(raw, token, min(self.top_logprobs, raw.shape[-1]))
        mx.async_eval(*entry)
        self._pending.append(entry)

    def process(self, logits: mx.array, history: Sequence[int]) -> mx.array:
        """`logits` (float32) through the processors, in the chain's order."""
        logits = logits.astype(mx.float32)
        for p in self.processors:
            logits = p(logits, history)
        return logits

    @staticmethod
    def logprobs(processed: mx.array) -> mx.array:
        """Log-probabilities `[V]` of processed logits (what the pick chooses from, before
        temperature and the top-k/top-p/min-p cuts)."""
        return processed - mx.logsumexp(processed)

    def accept(self, tokens: Sequence[int]) -> None:
        for p in self.processors:
            p.accept(tokens)
        for token in tokens:
            if self._pending:
                chosen, top, values = self._pending.pop(0)
                pairs = sorted(zip(top.tolist(), values.tolist()), key=lambda p: -p[1])
                self.recorded.append(TokenLogprob(token, chosen.item(), pairs))

    def pick(self, logits: mx.array) -> mx.array:
        """The next token from processed logits `[V]` (see `pick_rows`)."""
        return _picks([logits], [self])[0]

    def draws(self, processed: mx.array) -> mx.array:
        """A seeded verify step's tokens `[k+1]`: row i of `processed` picked as plain decoding
        picks it, with the next key of the chain. `stood` then keeps only the keys of the
        tokens that stood, so the next draw takes the key plain decoding would."""
        picks, self._drawn = [], []
        for i in range(processed.shape[0]):
            picks.append(self.pick(processed[i]))
            self._drawn.append(self.key)
        return mx.stack(picks)

    def residual(self, processed: mx.array, drafts: Sequence[int], key: mx.array | None
                 ) -> tuple[mx.array, mx.array]:  # fmt: skip
        """Speculative sampling's draws for a verify step's processed logits `[k+1, V]`:
        (p_draft `[k]`: the probability row i's cut distribution gives `drafts[i]`, fallback
        `[k+1]`: a token drawn from row i without `drafts[i]`, renormalized; row k draws from
        its whole distribution). On the CPU one native pass over the rows; elsewhere MLX's ops
        over all rows at once. Both draw by inverse CDF at the same uniforms from `key`."""
        k, p = len(drafts), self.p
        ids = mx.array([*drafts, -1], dtype=mx.int32)
        u = mx.random.uniform(shape=(k + 1,), key=key)
        native = sample_excluding(processed, u, ids, temperature=p.temperature,
                                  top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)  # fmt: skip
        if native is not None:
            fallback, p_draft = native
            return p_draft[:k], fallback
        final = self.final_logits(processed)
        d = ids[:k]
        p_draft = mx.take_along_axis(mx.softmax(final[:k], axis=-1), d[:, None], axis=-1)[:, 0]
        is_draft = mx.arange(final.shape[-1])[None] == d[:, None]
        residual = mx.concatenate([mx.where(is_draft, -mx.inf, final[:k]), final[k:]])
        return p_draft, draw(residual, u)

    def final_logits(self, logits: mx.array) -> mx.array:
        """What a sampled pick draws from: `logits / temperature` `[..., V]` with the top-k,
        min-p and top-p cuts of each row set to -inf (temperature > 0; speculative sampling
        reads it too)."""
        p = self.p
        logits = logits / p.temperature
        V = logits.shape[-1]
        if p.top_k:
            # the k-th largest value: a partition, not a sort of the vocabulary (2.7 vs 24 ms
            # over 248k logits on a CPU core)
            kth = mx.topk(logits, min(p.top_k, V), axis=-1).min(axis=-1, keepdims=True)
            logits = mx.where(logits < kth, -mx.inf, logits)
        if not p.min_p and p.top_p >= 1.0:
            return logits  # no cut needs the probabilities: skip a softmax over the vocabulary
        probs = mx.softmax(logits, axis=-1)
        if p.min_p:
            top = probs.max(axis=-1, keepdims=True)
            logits = mx.where(probs < p.min_p * top, -mx.inf, logits)
        if p.top_p < 1.0:
            # Keep each token whose more probable tokens hold less than top_p of the mass (the
            # first always stays; tokens tied at the boundary stay together). That is every
            # probability >= tau, the smallest value whose predecessors in descending order
            # hold less than top_p. After a top-k cut only k values can be kept, so only they
            # are sorted: 20 values instead of a 248k argsort and scatter (32 ms a token).
            values = mx.topk(probs, min(p.top_k, V), axis=-1) if p.top_k else probs
            ranked = mx.sort(values, axis=-1)[..., ::-1]
            before = mx.cumsum(ranked, axis=-1) - ranked
            tau = mx.where(before < p.top_p, ranked, mx.inf).min(axis=-1, keepdims=True)
            logits = mx.where(probs < tau, -mx.inf, logits)
        return logits

    def uniform(self) -> mx.array:
        """The uniform in [0, 1) of this row's next draw: from its own key when seeded (so a
        seeded row draws the same tokens whatever rows are picked beside it), else from
        MLX's global generator."""
        return mx.random.uniform(key=self.subkey())

    def subkey(self) -> mx.array | None:
        """The next random key of a seeded row (None unseeded: MLX's global generator)."""
        if self.key is None:
            return None
        self.key, sub = mx.random.split(self.key)
        return sub


def pick_rows(samplers: Sequence[Sampler], logits: Sequence[mx.array],
              histories: Sequence[Sequence[int]]) -> list[mx.array]:  # fmt: skip
    """Each row's next token, as `samplers[i](logits[i], histories[i])` picks it alone, with
    the picks of rows that share their cuts made in one call (`_picks`). Each row's
    processors see its own logits and history, and each row's uniform comes from its own
    key: a row's tokens do not depend on the rows beside it. If this raises, no sampler has
    taken a pick (`Sampler.begin`): the picks can be made again, together or row by row."""
    processed = [s.begin(x, h) for s, x, h in zip(samplers, logits, histories, strict=True)]
    # A group's draw splits its seeded rows' keys, and `end` takes the pick: if a later
    # group or row fails, the rows before it go back, or a retry would draw other tokens.
    saved = [(s.key, len(s._pending)) for s in samplers]
    try:
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(samplers):
            groups.setdefault(s.cuts, []).append(i)
        picks: list = [None] * len(samplers)
        for rows in groups.values():
            tokens = _picks([processed[i] for i in rows], [samplers[i] for i in rows])
            for i, token in zip(rows, tokens):
                picks[i] = token
        for s, x, pick in zip(samplers, logits, picks):
            s.end(x, pick)
    except BaseException:
        for s, (key, pending) in zip(samplers, saved):
            s.key, s._last = key, None
            del s._pending[pending:]
        raise
    return picks


def _picks(rows: list[mx.array], samplers: Sequence[Sampler]) -> list[mx.array]:
    """The tokens of processed logits rows `[V]` whose samplers share their cuts: greedy, or
    drawn after the cuts at each row's uniform. On the CPU the cuts and the draw are one
    native pass over the rows where they lie (`kernels.sampling`), and greedy rows take an
    argmax each (a stack would copy them first, for nothing); elsewhere the rows are stacked
    and go through one set of MLX ops along the last axis (`final_logits`, `draw`)."""
    p = samplers[0].p
    one = len(rows) == 1
    cpu = device_kind() == "cpu"
    if p.temperature == 0:
        if one or cpu:
            return [mx.argmax(x) for x in rows]
        return list(mx.argmax(mx.stack(rows), axis=-1))
    u = samplers[0].uniform() if one else mx.stack([s.uniform() for s in samplers])
    cuts = dict(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
    picked = sample(rows[0], u, **cuts) if one else sample_rows(rows, u, **cuts)
    if picked is not None:
        return [picked] if one else list(picked)
    x = rows[0] if one else mx.stack(rows)
    picked = draw(samplers[0].final_logits(x), u)
    return [picked] if one else list(picked)


def draw(final: mx.array, u: mx.array) -> mx.array:
    """Per row of `final` `[..., V]` (cut logits: -inf where cut), the first token whose
    running weight in index order exceeds `u` (`[...]`, in [0, 1)) times the row's total:
    a categorical draw by inverse CDF, the native pass's. A row whose rounding leaves the
    target past its end takes its most likely token, never a cut one."""
    w = mx.softmax(final, axis=-1)
    run = mx.cumsum(w, axis=-1)
    past = mx.logical_and(run > u[..., None] * run[..., -1:], w > 0)
    return mx.where(past.any(axis=-1), mx.argmax(past, axis=-1), mx.argmax(final, axis=-1))
