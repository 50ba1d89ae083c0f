"""Qwen3.5's multi-token prediction (MTP) head, and the drafter built on it.

Every Qwen3.5 checkpoint carries one MTP layer (`mtp.*`), trained to predict the token after
next. At position j it takes the target's final (normed) hidden state h_j and the embedding
of token j+1, norms each (`pre_fc_norm_hidden`, `pre_fc_norm_embedding`), joins them
embedding first through `fc` (2H -> H), runs one full-attention decoder layer with its own
KV cache, norms (`mtp.norm`) and reads the target's LM head: logits for token j+2. Drafting
k tokens chains it: each step's normed output stands in for h at the next position (as vLLM's
`qwen3_5_mtp` and llama.cpp's `qwen35` MTP graph do).

The head's cache (`cache.MTPCache`) is kept in step with the target by every forward pass
(`MTPHead.advance`, called from `Qwen35.hidden`): prefill, decode and verify steps append one
row per position whose next token is known, and the target's last hidden state is kept for
the first draft. It is therefore snapshotted, restored, rolled back, forked and saved with
the other caches, and always equals what a fresh prefill of the same tokens computes. A draft
writes rows past the live end and trims them before it returns.
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

    def advance(self, embeds: mx.array, h: mx.array, cache: MTPCache) -> None:
        """Keep `cache` in step with a target pass from `cache.offset` over tokens with
        embeddings `embeds` and final hidden states `h` (`[B, T, H]` each).

        Appends the rows whose next token is now known: (h before the pass, first token),
        then (h_t, token t+1) inside it; only their keys and values are computed (a row's
        output is never read). Records the hidden state at each `cache.capture` position."""
        T = h.shape[1]
        if cache.offset:
            hidden = mx.concatenate([cache.state, h[:, :-1]], axis=1)
        else:  # the first token has no position before it
            embeds, hidden = embeds[:, 1:], h[:, :-1]
        if hidden.shape[1]:
            attn, kv = self.layers[0], cache.kv
            x = attn.input_layernorm(self._join(embeds, hidden))
            _, k, v, _ = attn.self_attn.project(x, kv.offset)
            kv.update(k, v)
        for p in cache.capture:
            if 0 < p < T:
                cache.record(p, None, h[:, p - 1 : p])
        cache.update(None, h[:, -1:], T)

    def draft(self, model, cache: MTPCache, token: int, k: int) -> list[int]:
        """k greedy drafts after `token` (the next token, not yet fed); `cache` as it was."""
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
