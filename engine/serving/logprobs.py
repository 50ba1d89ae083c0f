"""Token log-probabilities in OpenAI's shape (`choices[].logprobs.content`), for every face
that reports them: each entry names the token's text, its bytes and the top alternatives."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from ..runtime.sampling import TokenLogprob


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet back to bytes (the vocabulary's spelling of raw bytes)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def token_bytes(tokenizer, token: int) -> bytes:
    """The bytes a token stands for (an added token such as `<tool_call>`: its text)."""
    piece = tokenizer.backend.id_to_token(token) or ""
    table = _byte_decoder()
    if all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return piece.encode("utf-8")


def _entry(tokenizer, token: int, logprob: float) -> dict:
    raw = token_bytes(tokenizer, token)
    return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}


def openai_content(tokenizer, logprobs: Sequence[TokenLogprob]) -> list[dict]:
    """`logprobs.content` of a chat completion (or of one streamed chunk)."""
    return [
        {
            **_entry(tokenizer, lp.token, lp.logprob),
            "top_logprobs": [_entry(tokenizer, t, v) for t, v in lp.top],
        }  # fmt: skip
        for lp in logprobs
    ]
