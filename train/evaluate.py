"""Does `tiny-chat` remember? Seed 002's memory scenario on chats the training never saw.

    python -m train.evaluate [--n 120] [--path session|stateless|resumed]

Each case (`data.memory_chat`, seeded by `data.TEST_SEED`) states a fact in its first message,
chats about other things for `gap` exchanges, then asks for the fact: inside the six-exchange
window when gap < 6, dropped from it otherwise. A case scores when the answer holds the fact
(exact string) while it is in the window, and does not hold it once the window dropped it.
Greedy decoding over the full vocabulary, through the engine's own loader and paths.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np

from train import data

MAX_TOKENS = 32  # the longest scripted answer is ~25 tokens


@dataclass
class Case:
    chat: data.Chat
    fact: str  # the value stated in the first message
    inside: bool  # whether the question's prompt still holds it

    @property
    def messages(self) -> list[dict]:
        """The whole conversation as a stateless client resends it (scripted answers)."""
        head = [{"role": "system", "content": self.chat.system}] if self.chat.system else []
        *history, last = self.chat.exchanges
        return (
            head
            + [m for ex in self.chat.history(len(history)) for m in ex]
            + [{"role": "user", "content": last.user}]
        )


def cases(n: int, seed: int = data.TEST_SEED) -> list[Case]:
    """n cases, half with the fact inside the window (gap 0-5), half dropped (gap 6-9)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        gap = int(rng.integers(0, data.WINDOW)) if i % 2 == 0 else int(rng.integers(6, 10))
        chat = data.memory_chat(rng, gap)
        out.append(Case(chat, chat.exchanges[0].value, gap < data.WINDOW))
    return out


def score(results: list[tuple[Case, str]]) -> dict:
    """Recall while inside the window and non-recall once dropped, as fractions."""
    inside = [c.fact in text for c, text in results if c.inside]
    dropped = [c.fact not in text for c, text in results if not c.inside]
    return {
        "recall_inside": float(np.mean(inside)) if inside else float("nan"),
        "not_recalled_dropped": float(np.mean(dropped)) if dropped else float("nan"),
        "inside": len(inside),
        "dropped": len(dropped),
    }


def via_session(eng, case: Case) -> str:
    """Every message through one Session (the model's own answers form the history)."""
    chat = eng.session(case.chat.system, max_exchanges=data.WINDOW)
    turn = None
    for e in case.chat.exchanges:
        turn = chat.send(e.user, max_tokens=MAX_TOKENS)
    return turn.text


def via_stateless(eng, case: Case) -> str:
    """The whole conversation resent at once (as the server's clients do), windowed."""
    return eng.chat(case.messages, max_tokens=MAX_TOKENS, max_exchanges=data.WINDOW).text


def via_resumed(eng, case: Case, home: str | None = None) -> str:
    """As `chatml chat --session` keeps a chat: the conversation up to the question (the
    scripted exchanges, prefilled) saved in a session store, then reopened as a new process
    would (the caches from the disk, not re-prefilled) to answer the question."""
    import uuid

    from engine.storage.store import SessionStore

    store, sid = SessionStore(home), f"eval-{uuid.uuid4().hex[:12]}"
    *history, last = case.chat.exchanges
    chat = eng.session(case.chat.system, max_exchanges=data.WINDOW)
    chat.history = case.chat.history(len(history))
    chat.warm()  # the caches a finished turn leaves, up to where the next message starts
    store.attach(sid, chat).close()
    try:
        with store.open(sid, eng) as stored:
            assert stored.state_loaded, stored.state_error
            turn = stored.session.send(last.user, max_tokens=MAX_TOKENS)
            assert turn.stats.reused_tokens > 0, turn.stats
            return turn.text
    finally:
        store.remove(sid)


PATHS = {"session": via_session, "stateless": via_stateless, "resumed": via_resumed}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=120)
    p.add_argument("--path", choices=list(PATHS), default="stateless")
    p.add_argument("--model", default="tiny-chat")
    p.add_argument("--show", type=int, default=6, help="print this many answers")
    args = p.parse_args(argv)
    import engine

    eng = engine.load(args.model)
    results = []
    for i, case in enumerate(cases(args.n)):
        text = PATHS[args.path](eng, case)
        results.append((case, text))
        if i < args.show:
            print(
                f"[{'in ' if case.inside else 'out'}] {case.chat.exchanges[-1].user!r} -> {text!r}"
            )
    print(score(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
