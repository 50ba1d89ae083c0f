"""Write the hand-written golden cases: <name>.json (input) and <name>.txt (expected prompt).

The expected text is produced by the official template through transformers' chat-template
machinery, never by our renderer. Run from the repo root: `python tests/golden/regenerate.py`.
A case whose template raises gets `"error": true` and no .txt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from test_renderer_support import reference_render  # noqa: E402

U = {"role": "user", "content": "What's the weather in Paris?"}
SYS = {"role": "system", "content": "You are a helpful assistant."}
A = {"role": "assistant", "content": "It is sunny, 24 °C."}
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
        }
    ],
}
TOOL = {"role": "tool", "content": '{"temp": 24, "sky": "sunny"}', "tool_call_id": "c1"}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city. 天気を取得します。",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. 東京"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
NESTED = {
    "filters": {"tags": ["a", "ü"], "range": {"lo": 1, "hi": 2.5}},
    "limit": 10,
    "exact": True,
    "cursor": None,
    "query": "multi\nline",
}

CASES: dict[str, dict] = {
    "plain_single": {"messages": [U]},
    "plain_system": {"messages": [SYS, U]},
    "no_generation_prompt": {"messages": [SYS, U, A], "add_generation_prompt": False},
    "thinking_off": {"messages": [SYS, U], "enable_thinking": False},
    "thinking_on": {"messages": [SYS, U], "enable_thinking": True},
    "multi_turn": {"messages": [SYS, U, A, {"role": "user", "content": "And tomorrow?"}]},
    "reasoning_content_history": {
        "messages": [
            U,
            {**A, "reasoning_content": "Look it up."},
            {"role": "user", "content": "Thanks!"},
        ]
    },
    "reasoning_content_last": {
        "messages": [U, {**A, "reasoning_content": "\n  Look it up. \n"}],
        "add_generation_prompt": False,
    },
    "inline_think_last": {
        "messages": [U, {"role": "assistant", "content": "<think>\nHmm.\n</think>\n\nSunny."}],
        "add_generation_prompt": False,
    },
    "inline_think_history": {
        "messages": [U, {"role": "assistant", "content": "<think>Hmm.</think>Sunny."}, U]
    },
    "inline_think_no_open_tag": {
        "messages": [U, {"role": "assistant", "content": "reasoning only</think>\n\nok"}],
        "add_generation_prompt": False,
    },
    "thinking_alias": {
        "messages": [U, {**A, "thinking": "via the thinking field"}],
        "add_generation_prompt": False,
    },
    "tool_call_dict_args": {"messages": [SYS, U, CALL, TOOL], "tools": [WEATHER_TOOL]},
    "tool_call_nested_args": {
        "messages": [
            U,
            {
                "role": "assistant",
                "content": "Searching.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "search", "arguments": NESTED}}
                ],
            },
            TOOL,
        ]
    },
    "tool_call_flat_form": {
        "messages": [
            U,
            {
                "role": "assistant",
                "tool_calls": [{"name": "get_weather", "arguments": {"city": "東京"}}],
            },
            TOOL,
        ]
    },
    "tool_call_json_string_args": {
        "messages": [
            U,
            {
                "role": "assistant",
                "tool_calls": [
                    {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
                ],
            },
            TOOL,
        ]
    },
    "tool_calls_parallel_run": {
        "messages": [
            U,
            {**CALL, "tool_calls": CALL["tool_calls"] * 3},
            TOOL,
            TOOL,
            {**TOOL, "content": "third"},
        ]
    },
    "tool_loop_then_answer": {
        "messages": [
            U,
            CALL,
            TOOL,
            {**A, "reasoning_content": "done"},
            {"role": "user", "content": "ok"},
        ]
    },
    "tool_step_with_reasoning": {"messages": [U, {**CALL, "reasoning_content": "need data"}, TOOL]},
    "tools_no_system": {"messages": [U], "tools": [WEATHER_TOOL]},
    "tools_empty_system": {
        "messages": [{"role": "system", "content": "  "}, U],
        "tools": [WEATHER_TOOL],
    },
    "empty_system": {"messages": [{"role": "system", "content": ""}, U]},
    "content_parts_text": {
        "messages": [
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": "Be brief. "},
                    {"type": "text", "text": "Be kind."},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
            },
        ]
    },
    "content_image_video": {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "a.png"},
                    {"type": "text", "text": "and"},
                    {"type": "video", "video": "b.mp4"},
                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                ],
            }
        ]
    },
    "content_vision_ids": {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image"},
                    {"type": "image"},
                    {"type": "video"},
                    {"type": "text", "text": "?"},
                ],
            }
        ],
        "add_vision_id": True,
    },
    "cjk_emoji_whitespace": {
        "messages": [
            {"role": "system", "content": "\u3000 系统 🤖 \n"},
            {"role": "user", "content": " \t你好 👋🏽\r\n世界\u00a0"},
            {"role": "assistant", "content": "\n\n안녕 🇰🇷  "},
            {"role": "user", "content": "e\u0301 👨‍👩‍👧"},
        ]
    },
    "user_looks_like_tool_response": {
        "messages": [U, CALL, {"role": "user", "content": "<tool_response>\nx\n</tool_response>"}]
    },
    "leading_tool_message": {"messages": [{"role": "tool", "content": "orphan"}, U]},
    "preserve_thinking": {
        "messages": [U, {**A, "reasoning_content": "kept?"}, U],
        "preserve_thinking": True,
    },
    "scalar_args_types": {
        "messages": [
            U,
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "function": {
                            "name": "f",
                            "arguments": {"b": True, "n": None, "i": 3, "f": 0.5, "s": "str"},
                        }
                    }
                ],
            },
            TOOL,
        ]
    },
    "error_no_messages": {"messages": []},
    "error_system_not_first": {"messages": [U, SYS]},
    "error_no_user_query": {"messages": [SYS, {"role": "assistant", "content": "hi"}]},
    "error_unknown_role": {"messages": [U, {"role": "critic", "content": "no"}]},
    "error_content_dict": {"messages": [{"role": "user", "content": {"text": "hi"}}]},
    "error_system_image": {"messages": [{"role": "system", "content": [{"type": "image"}]}, U]},
    "error_bad_part": {"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
    "error_tool_call_no_name": {
        "messages": [
            U,
            {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]},
            TOOL,
        ]
    },
}
VARIANTS = {
    "preserve_thinking": ["qwen3.6", "qwen3.5"],
    "scalar_args_types": ["qwen3.5", "qwen3.6"],
    "thinking_off": ["qwen3.5", "qwen3.5-small"],
    "thinking_on": ["qwen3.5-small", "qwen3.6"],
    "plain_single": ["qwen3.5", "qwen3.5-small", "qwen3.6"],
}


def main() -> None:
    for old in list(HERE.glob("*.json")) + list(HERE.glob("*.txt")):
        old.unlink()
    for name, case in CASES.items():
        for variant in VARIANTS.get(name, ["qwen3.5"]):
            stem = f"{name}.{variant}"
            data = {"variant": variant, **case}
            kwargs = {k: v for k, v in data.items() if k not in ("variant", "messages")}
            try:
                text = reference_render(data["messages"], variant, **kwargs)
            except Exception:  # the template raises: so must we
                data["error"] = True
            else:
                (HERE / f"{stem}.txt").write_bytes(text.encode("utf-8"))
            (HERE / f"{stem}.json").write_text(
                json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8"
            )


if __name__ == "__main__":
    main()
