"""Qwen3.5's multi-token prediction (MTP) head, and the drafter built on it.

Every Qwen3.5 checkpoint carries one MTP layer (`mtp.*`), trained to predict the token after
next. At position j it takes the target's final (normed) hidden state h_j and the embedding
of token j+1, norms each (`pre_fc_norm_hidden`, `pre_fc_norm_embedding`), joins them
embedding first through `fc` (2H -> H), runs one full-attention decoder layer with its own
KV cache, norms (`mtp.norm`) and reads the target's LM head: logits for token j+2. Drafting
k tokens chains it: each step's normed output stands in for h at the next position (as vLLM's
`qwen3_5_mtp` and llama.cpp's `qwen35` MTP graph do).

The head's cache (`cache.MTPCache`) follows the target through every forward pass
(`MTPHead.advance`, called from `Qwen35.hidden` and `decode_rows`), but lazily: a pass only
adds its positions' hidden states and tokens to the inputs of the rows still to compute, and
the head runs when a draft needs them (`catch_up`: one batched pass over every pending row,
keys and values only), or when the lag would pass `MTPCache.max_lag`. So while the adaptive
policy has drafting off, plain decoding (and a short prefill) never runs the head, and a
probe pays one batched pass for what it missed. The pending inputs are cache state like the
rows: snapshotted, restored, rolled back, forked and saved with the other caches, and once
caught up the rows equal what a fresh prefill of the same tokens computes (to rounding: the
same rows, computed in other groupings). A draft writes rows past the live end and trims
them before it returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from ..checkpoints.registry import Architecture
from .cache import MTPCache
from .model import DecoderLayer, ModelOptions, RMSNorm


class MTPHead(nn.Module):
    """The `mtp.*` weights: `fc`, the two input norms, `layers.0` (full attention), `norm`."""

    def __init__(self, a: Architecture, options: ModelOptions):
        super().__init__()
        h, eps = a.hidden_size, a.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(h, eps)
        self.pre_fc_norm_hidden = RMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = [DecoderLayer(a, "full_attention", options)]
        self.norm = RMSNorm(h, eps)

    def _join(self, embeds: mx.array, hidden: mx.array) -> mx.array:
        """fc([norm(embedding of token j+1), norm(h_j)]): `[B, T, H]` each, embedding first."""
        e = self.pre_fc_norm_embedding(embeds)
        return self.fc(mx.concatenate([e, self.pre_fc_norm_hidden(hidden)], axis=-1))

    def __call__(self, embeds: mx.array, hidden: mx.array, kv) -> mx.array:
        """The head's normed output `[B, T, H]`; the T rows are appended to `kv`."""
        return self.norm(self.layers[0](self._join(embeds, hidden), kv))

    def advance(self, ids: mx.array, h: mx.array, cache: MTPCache, embed) -> None:
        """Keep `cache` in step with a target pass from `cache.offset` over tokens `ids`
        `[B, T]` with final hidden states `h` `[B, T, H]` (`embed`: the token embedding).

        The rows whose next token is now known ((h before the pass, first token), then
        (h_t, token t+1) inside it) join the pending ones as inputs; the head runs only if
        that makes more than `cache.max_lag` pending, and then over all of them at once.
        Records the cache's state at each `cache.capture` position."""
        T = h.shape[1]
        ids = ids.astype(mx.int32)
        if cache.offset:
            hidden = mx.concatenate([cache.state, h], axis=1)
            pending = ids if cache.ids is None else mx.concatenate([cache.ids, ids], axis=1)
        else:  # the first token has no position before it
            hidden, pending = h, ids[:, 1:]
        before = hidden.shape[1] - T  # positions pending before the pass
        now = pending.shape[1] > cache.max_lag
        for p in cache.capture:
            if 0 < p < T:
                if now:  # the rows up to it are computed below
                    cache.record(p, None, hidden[:, before + p - 1 : before + p])
                else:
                    cache.record(p, _some(pending[:, : before + p - 1]), hidden[:, : before + p])
        if now:
            self._rows(embed(pending), hidden[:, :-1], cache.kv)
            hidden, pending = hidden[:, -1:], None
        cache.update(_some(pending), hidden, T)

    def catch_up(self, cache: MTPCache, embed) -> None:
        """Compute every pending row of `cache` in one pass (nothing to do if none is)."""
        if cache.ids is None:
            return
        self._rows(embed(cache.ids), cache.state[:, :-1], cache.kv)
        cache.ids, cache.state = None, cache.state[:, -1:]

    def _rows(self, embeds: mx.array, hidden: mx.array, kv) -> None:
        """Append the rows pairing `hidden` `[B, T, H]` with `embeds` `[B, T, H]` to `kv`, at
        its offset: only their keys and values (a row's output is never read)."""
        attn = self.layers[0]
        x = attn.input_layernorm(self._join(embeds, hidden))
        _, k, v, _ = attn.self_attn.project(x, kv.offset)
        kv.update(k, v)

    def draft(self, model, cache: MTPCache, token: int, k: int) -> list[int]:
        """k greedy drafts after `token` (the next token, not yet fed). `cache` catches up
        first (its pending rows are computed, in the same graph as the drafts), and is
        otherwise left as it was."""
        self.catch_up(cache, model.embed_tokens)
        kv = cache.kv
        start = kv.offset
        hidden, ids, out = cache.state, mx.array([[token]]), []
        for _ in range(k):
            hidden = self(model.embed_tokens(ids), hidden, kv)  # [1, 1, H]
            ids = mx.argmax(model.logits(hidden)[:, -1], axis=-1)[:, None]
            out.append(ids)
        drafts = mx.concatenate(out, axis=1)[0]
        mx.eval(drafts, kv.keys, kv.values)  # one wait for all k; nothing lazy is left behind
        kv.restore(start)
        return drafts.tolist()


class MTPDrafter:
    """Drafts with the checkpoint's MTP head (a `speculative.Drafter`): needs the caches of
    the sequence it drafts for (`bind`), whose last one is the head's `MTPCache`."""

    def __init__(self):
        self.model, self.cache = None, None

    def bind(self, model, caches: list) -> None:
        cache = caches[-1]
        if getattr(model, "mtp", None) is None or not isinstance(cache, MTPCache):
            raise ValueError("MTP drafting needs a model loaded with speculative='mtp'")
        self.model, self.cache = model, cache

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        if self.cache.offset != len(history) - 1:
            raise RuntimeError(
                f"the MTP cache is at {self.cache.offset}, the history needs {len(history) - 1}"
            )
        if k <= 0 or self.cache.state is None:
            return []
        return self.model.mtp.draft(self.model, self.cache, history[-1], k)


def _some(ids: mx.array | None) -> mx.array | None:
    """Pending ids as `MTPCache.ids` keeps them: None for none."""
    return None if ids is None or ids.shape[1] == 0 else ids
