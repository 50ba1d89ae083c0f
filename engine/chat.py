"""`chatml chat`: a conversation on the terminal, or one answer per line of piped input."""

from __future__ import annotations

import argparse
import sys


def add_chat_parser(sub) -> None:
    c = sub.add_parser("chat", help="chat with a model (interactive, or line by line from a pipe)")
    c.add_argument("--model", default="tiny", help="registry alias, checkpoint folder or Hub id")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--max-exchanges", type=int, default=6, help="exchanges kept in the window")
    c.add_argument("--max-tokens", type=int, default=256, help="answer length limit")
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="thinking mode (default: the model's)")  # fmt: skip
    c.add_argument("--no-history", action="store_true", help="every question on its own")
    c.add_argument("--stats", action="store_true", help="print token counts and timings per turn")
    c.add_argument("-p", "--prompt", default=None, help="ask one question and exit")
    c.set_defaults(func=run_chat)


def _stats_line(turn) -> str:
    s = turn.stats
    return (
        f"[prompt {s.prompt_tokens} tok: reused {s.reused_tokens}, prefilled "
        f"{s.prefilled_tokens}; generated {s.generated_tokens}; ttft {s.ttft_s * 1000:.0f} ms; "
        f"decode {s.decode_tps:.1f} tok/s; dropped {s.dropped_exchanges} exchanges]"
    )


def run_chat(args) -> int:
    if args.no_history and args.prompt is not None:
        print("chatml chat: --no-history has no effect with -p (one question has no history)",
              file=sys.stderr)  # fmt: skip
        return 2
    import engine

    eng = engine.load(args.model)
    session = eng.session(args.system, max_exchanges=args.max_exchanges,
                          enable_thinking=args.thinking)  # fmt: skip
    options = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    interactive = args.prompt is None and sys.stdin.isatty()
    questions = [args.prompt] if args.prompt is not None else _lines(interactive)
    for question in questions:
        if not question.strip():
            continue
        if args.no_history:
            session.reset()
        try:
            for item in session.stream(question, **options):
                if isinstance(item, str):
                    sys.stdout.write(item)
                    sys.stdout.flush()
                else:
                    sys.stdout.write("\n")
                    if args.stats or not interactive:
                        print(_stats_line(item), file=sys.stderr if interactive else sys.stdout)
        except KeyboardInterrupt:
            print("\n[interrupted: the question was not recorded]", file=sys.stderr)
        except ValueError as e:  # bad input: the conversation is unchanged
            print(f"error: {e}", file=sys.stderr)
    return 0


def _lines(interactive: bool):
    while True:
        try:
            line = input(">>> ") if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            if interactive:
                print()
            return
        if not interactive and not line:
            return
        yield line.rstrip("\n")
