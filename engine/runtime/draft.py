"""A separate draft model (`speculative="draft:NAME"`): a smaller model with the target's
tokenizer proposes the tokens, greedily, from its own hybrid cache.

The draft model's caches are its own `CachedSequence`s (a few, reused by token ids as the
server's pool reuses the target's): at the first proposal of an answer the best one is brought
to the prompt (restoring its deepest reusable snapshot, prefilling the rest, snapshotting
after each `<|im_start|>` it passes, where a later prompt diverges: the re-rendered answer,
a trimmed window, a regenerated turn), so across turns it is rebuilt only where the
conversation changed. Inside an answer each draft token is one step of the draft
model; a draft that did not stand is undone with that step's mark (`step.rollback`: KV
trimmed, Gated DeltaNet states restored), so the draft caches always hold exactly the tokens
that stood. The draft model runs on the target's model thread, inside its answer.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import mlx.core as mx

from ..checkpoints.loader import CheckpointError
from .generate import eval_caches, prefill
from .sequence import CachedSequence, common_prefix
from .step import Mark, Row, forward, rollback

SEQUENCES = 4  # draft caches kept (one per conversation the target serves, LRU)


class DraftModel:
    """The draft engine and its cached sequences, shared by every answer of the target.

    `prefilled` counts the draft model's prefill tokens (how much reuse across turns saved)."""

    def __init__(self, name: str):
        self.name = name
        self.engine = None
        self.sequences: list[CachedSequence] = []
        self.prefilled = 0
        self.drafters: weakref.WeakSet[DraftDrafter] = weakref.WeakSet()  # answers drafting

    def load(self, target) -> None:
        """Load the draft model for `target` (an Engine): same tokenizer, same compute dtype."""
        from ..engine import load

        draft = load(self.name, dtype=str(target.dtype).rsplit(".", 1)[-1])
        ours, theirs = target.path / "tokenizer.json", draft.path / "tokenizer.json"
        if (target.entry.arch.vocab_size != draft.entry.arch.vocab_size
                or ours.read_bytes() != theirs.read_bytes()):  # fmt: skip
            raise CheckpointError(  # a ValueError the CLI reports as a bad model
                f"speculative='draft:{self.name}': the draft model's tokenizer differs from "
                f"{target.path.name}'s; a draft model must share the target's token ids"
            )
        self.engine = draft

    def __call__(self) -> DraftDrafter:
        """A drafter for one answer (the `Speculation.drafter` factory)."""
        if self.engine is None:
            raise RuntimeError(f"draft model {self.name!r} is not loaded (engine.load does it)")
        drafter = DraftDrafter(self)
        self.drafters.add(drafter)  # until its answer lets go of it
        return drafter

    def sequence_for(self, ids: Sequence[int]) -> CachedSequence:
        """The draft sequence that can restore most of `ids` (a new one while there is room,
        else the least recently used), among those no other answer drafts on: answers
        decoding at once would prefill their own tokens over each other's at every step."""
        held = {id(d.seq) for d in self.drafters if d.seq is not None}
        free = [s for s in self.sequences if id(s) not in held]
        pool = free if free or len(self.sequences) < SEQUENCES else self.sequences
        best = max(pool, key=lambda s: (s.reusable(ids, need_logits=False),
                                        s.last_used), default=None)  # fmt: skip
        if best is None or (best.reusable(ids, need_logits=False) == 0
                            and len(self.sequences) < SEQUENCES):  # fmt: skip
            best = CachedSequence(self.engine)
            self.sequences.append(best)
        return best


class DraftDrafter:
    """One answer's drafter (a `speculative.Drafter`) on a `DraftModel`."""

    def __init__(self, draft: DraftModel):
        self.draft = draft
        self.seq: CachedSequence | None = None
        self.marks: dict[int, Mark] = {}  # start position -> the draft step that began there

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        model = self.draft.engine.model
        ids = list(history[:-1])  # what the draft caches must hold: all but the pending token
        with self.draft.engine.lock:
            try:
                self._sync(ids)
                caches, token, out = self.seq.caches, mx.array(history[-1:]), []
                for _ in range(k):  # the pending token, then each draft but the last
                    ((logits, mark),) = forward(model, [Row(caches, token)])
                    self.marks[mark.start] = mark
                    token = mx.argmax(logits[-1], keepdims=True).astype(mx.uint32)  # [1]
                    out.append(token)
                drafts = mx.concatenate(out)
                eval_caches(caches, drafts)
                drafts = drafts.tolist()
            except BaseException:  # the caches may hold anything: start this one afresh
                if self.seq is not None:
                    self.seq.drop_cache()
                self.seq, self.marks = None, {}
                raise
            self.seq.tokens = [*history, *drafts[:-1]]
        return drafts

    def _sync(self, ids: list[int]) -> None:
        """Bring the draft caches to hold exactly `ids`."""
        seq = self.seq
        keep = common_prefix(seq.tokens, ids) if seq is not None else 0
        if seq is not None and keep < len(seq.tokens) and keep in self.marks:
            rollback(seq.caches, self.marks[keep], keep)  # drafts that did not stand
            seq.tokens = seq.tokens[:keep]
        self.marks = {}  # the history only grows: no later rollback reaches below `keep`
        if seq is not None and keep == len(seq.tokens):
            if keep < len(ids):  # what came after the drafts that stood (the last draft had
                # no step of its own; plain decoding may have run since)
                prefill(seq.engine.model, seq.caches, ids, keep, logits=False)
                seq.tokens = list(ids)
            return
        # The first proposal of the answer: the best sequence, from its deepest snapshot.
        self.seq = seq = seq or self.draft.sequence_for(ids)
        start_token = self.draft.engine.tokenizer.token_id("<|im_start|>")
        stops = [i + 1 for i, t in enumerate(ids) if t == start_token] + [len(ids)]
        start, end = seq.extend(ids, stops=stops, chunk=512)
        self.draft.prefilled += end - start
