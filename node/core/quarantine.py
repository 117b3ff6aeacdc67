"""Sequences suspected of killing their engine are recomputed alone (pure scheduling policy).

When a device's engine process dies, the sequences of the step it was computing are *suspects*: one of
them may be what killed it (an input that crashes a kernel, a context that runs the device out of
memory). Each is resumed (:mod:`node.runtime.resume`) in quarantine: until it has computed again as far
as that fatal step went (``until``, tokens), every step on its device that could include it includes
nothing else, one suspect at a time. If the engine dies again in such a step, the suspect alone was in
it: it is the cause, and it is not resumed again. Bystanders lose a little throughput during the
replay, never their streams. Decode steps go on meanwhile for the others: a suspect is recomputing (a
prompt-like step), so it is never in one.
"""

from __future__ import annotations

from collections import deque

from node.core.batcher import Batcher, StepKind, StepPlan
from node.core.sequence import Sequence, SeqStatus


class Quarantine:
    """The suspects queued on one device, in arrival order, each with the token count it must reach."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Sequence, int]] = deque()
        self._alone: list[StepPlan] = []  # steps planned with a suspect alone whose outcome is not known

    def add(self, seq: Sequence, until: int) -> None:
        """Run ``seq`` alone until it has computed ``until`` tokens (the end of its fatal step)."""
        self._queue.append((seq, until))

    def clear(self) -> None:
        self._queue.clear()
        self._alone.clear()

    def ran_alone(self, plan: StepPlan) -> bool:
        """Whether ``plan``, a step whose outcome is not known, carried a suspect alone."""
        return any(p is plan for p in self._alone)

    def settled(self, plan: StepPlan) -> None:
        """``plan`` came back from the engine (call for every step that did): a suspect it carried
        survived it. Only then may its quarantine end: a step planned is not a step computed."""
        self._alone = [p for p in self._alone if p is not plan]

    def __len__(self) -> int:
        return len(self._queue)

    def head(self, batcher: Batcher) -> Sequence | None:
        """The suspect to run now: the oldest one still on ``batcher`` that is short of its mark or has a
        step out (the others left: finished, aborted, moved away, or past the point where the engine
        died and back from it)."""
        while self._queue:
            seq, until = self._queue[0]
            held = seq.status is not SeqStatus.FINISHED and (seq in batcher.running or seq in batcher.waiting)
            if held and (seq.num_computed < until or any(p.items[0].seq is seq for p in self._alone)):
                return seq
            self._queue.popleft()
            self._alone = [p for p in self._alone if p.items[0].seq is not seq]
        return None

    def _until(self, seq: Sequence) -> int:
        return next(until for s, until in self._queue if s is seq)

    def schedule(self, batcher: Batcher, kind: StepKind, chunk_tokens: int | None = None) -> StepPlan:
        """``batcher.schedule(kind, chunk_tokens)``, except that a step that could take prompt work
        (not DECODE) carries only the head suspect while there is one, and none is planned while its
        last quarantine step is out (the engine may yet die in it). The newest other running
        sequences are preempted first when the suspect's whole context would not fit the free blocks
        (they hold them and would not run until it is done)."""
        seq = self.head(batcher) if kind is not StepKind.DECODE else None
        if seq is None:
            return batcher.schedule(kind, chunk_tokens)
        plan = StepPlan(kind)
        if seq.num_computed >= self._until(seq):
            return plan  # its last quarantine step is out: nothing until it is back
        need = batcher.ledger.blocks_for(len(seq.token_ids) + 1) - len(seq.block_ids)
        for other in reversed(list(batcher.running)):
            if need <= batcher.ledger.num_free:
                break
            if other is not seq:
                batcher.preempt(other, plan)
        run, wait = batcher.running, batcher.waiting
        batcher.running = [s for s in run if s is seq]
        batcher.waiting = [s for s in wait if s is seq]
        try:
            alone = batcher.schedule(kind, chunk_tokens)
        finally:
            others = [s for s in run if s is not seq]
            if seq not in batcher.running:
                batcher.running = others
            elif seq not in run:
                batcher.running = others + [seq]  # admitted now: the newest running sequence
            else:
                batcher.running = run  # it kept its place
            solo_waiting = [seq] if seq in batcher.waiting else []
            batcher.waiting = sorted([s for s in wait if s is not seq] + solo_waiting, key=Sequence.sort_key)
        alone.preempted[:0] = plan.preempted
        if alone.items:
            self._alone.append(alone)
        return alone
