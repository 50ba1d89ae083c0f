"""Validation of engine-facing input: each error names the message index and the field."""

from __future__ import annotations

import pytest

from renderer import RenderError, build_prompt, split_conversation, validate_messages

U = {"role": "user", "content": "hi"}
A = {"role": "assistant", "content": "hello"}
CALL = {
    "role": "assistant",
    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
}
T = {"role": "tool", "content": "result"}


@pytest.mark.parametrize(
    "messages, index, field, reason",
    [
        ([U, {"role": "bot", "content": "x"}], 1, "role", "role must be one of"),
        ([U, {"role": "system", "content": "x"}], 1, "role", "only allowed first"),
        ([{"role": "user", "content": 5}], 0, "content", "string or a list of parts"),
        ([{"role": "user", "content": {"text": "x"}}], 0, "content", "string or a list of parts"),
        ([{"role": "user", "content": "  \n"}], 0, "content", "must not be empty"),
        ([{"role": "user", "content": [{"type": "text", "text": " "}]}], 0, "content", "empty"),
        (
            [{"role": "user", "content": [{"type": "audio"}]}],
            0,
            "content[0]",
            "unknown content part",
        ),
        ([{"role": "user", "content": ["x"]}], 0, "content[0]", "must be a dict"),
        # The template reads a part as text only when it has "text" (it raises otherwise).
        ([{"role": "user", "content": [{"type": "text"}]}], 0, "content[0].text", "needs its"),
        ([{"role": "system", "content": [{"type": "text"}]}, U], 0, "content[0].text", "needs"),
        (
            [{"role": "user", "content": [{"type": "text", "text": 3}]}],
            0,
            "content[0].text",
            "must be a string",
        ),
        ([{"role": "system", "content": [{"type": "image"}]}, U], 0, "content[0]", "image"),
        (
            [{"role": "user", "content": "<tool_response>x</tool_response>"}],
            0,
            "content",
            "role 'tool'",
        ),
        ([U, {"role": "assistant"}], 1, "content", "needs content or tool_calls"),
        ([U, {"role": "assistant", "tool_calls": {"name": "f"}}], 1, "tool_calls", "a list"),
        (
            [U, {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}],
            1,
            "tool_calls[0].function.name",
            "non-empty string",
        ),
        (
            [
                U,
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}],
                },
            ],
            1,
            "tool_calls[0].function.arguments",
            "not valid JSON",
        ),
        (
            [
                U,
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}],
                },
            ],
            1,
            "tool_calls[0].function.arguments",
            "JSON object",
        ),
        (
            [U, {"role": "assistant", "content": "x", "reasoning_content": 3}],
            1,
            "reasoning_content",
            "string",
        ),
        ([{"role": "user", "content": "x", "tool_calls": []}], 0, "tool_calls", "only assistant"),
        ([U, {"role": "tool"}], 1, "content", "needs content"),
        (["hello"], 0, None, "must be a dict"),
    ],
)
def test_validate_messages_errors(messages, index, field, reason) -> None:
    with pytest.raises(RenderError) as info:
        validate_messages(messages)
    e = info.value
    assert (e.index, e.field) == (index, field)
    assert reason in str(e) and f"message {index}" in str(e)


def test_validate_messages_ok_and_normalizes() -> None:
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"k": 1}'}}],
    }
    out = validate_messages([{"role": "system", "content": "s"}, U, call, T])
    assert out[2]["tool_calls"][0]["function"]["arguments"] == {"k": 1}
    assert out[1] == U and out[1] is not U
    with pytest.raises(RenderError):
        validate_messages([])


@pytest.mark.parametrize(
    "history, where, field",
    [
        ([[A]], "history[0] message 0", "role"),
        ([[U]], "history[0] message 0", "role"),
        ([[U, A, U, A]], "history[0] message 2", "role"),
        ([[U, T, A]], "history[0] message 1", "role"),
        ([[U, CALL, A]], "history[0] message 2", "role"),
        ([[U, A, A]], "history[0] message 1", "tool_calls"),
        ([[U, CALL, T]], "history[0] message 2", "role"),
        ([[U, A], []], "history[1]", None),
        ([[U, {"role": "critic", "content": "x"}, A]], "history[0] message 1", "role"),
    ],
)
def test_history_exchange_errors(history, where, field) -> None:
    with pytest.raises(RenderError) as info:
        build_prompt(lambda s: [0], system=None, history=history, current=[U])
    assert str(info.value).startswith(where)
    assert info.value.field == field


@pytest.mark.parametrize(
    "current, where",
    [
        ([], "current"),
        ([A], "current message 0"),
        ([U, A], "current message 1"),
        ([U, CALL], "current message 1"),
        ([U, U], "current message 1"),
        ([U, CALL, T, CALL], "current message 3"),
    ],
)
def test_current_exchange_errors(current, where) -> None:
    with pytest.raises(RenderError) as info:
        build_prompt(lambda s: [0], system=None, history=[], current=current)
    assert str(info.value).startswith(where)


def test_system_type_checked() -> None:
    with pytest.raises(RenderError, match="system"):
        build_prompt(lambda s: [0], system=["x"], history=[], current=[U])


def test_split_conversation() -> None:
    msgs = [{"role": "system", "content": [{"type": "text", "text": " sys "}]}, U, A, U, CALL, T]
    system, history, current = split_conversation(msgs)
    assert system == "sys"
    assert history == [[U, A]]
    assert current == [U, CALL, T]
    assert split_conversation([U]) == (None, [], [U])
