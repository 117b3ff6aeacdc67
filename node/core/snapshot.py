"""The role policies' view of a node (:class:`~node.core.roles.NodeSnapshot`), built in one place for the
live node (:meth:`node.runtime.role_driver.RoleDriver.snapshot`) and the simulator
(:meth:`bench.sim.timeshared.TimeSharedSim.snapshot`), so the two cannot drift apart (pure: no I/O).

Each caller describes its devices as :class:`DeviceView` s (the raw facts: role, step in flight,
batcher, the requests placed there) and :func:`node_snapshot` applies the rules:

* a *resident* is a decoding sequence (``num_output > 0`` and one token to compute); a sequence whose
  move is under way (``moving``: sequence id → destination) counts on its destination, cooling down
  (``moved_s = now``), and one leaving for a device not among the views (a peer, a device that went
  down) counts nowhere; a move not applied yet (the sequence still in its source's running list)
  reserves its blocks on the destination (*incoming*);
* everything else placed and unfinished is queued prompt work: its uncomputed tokens and one
  sequence each;
* each request's placement reserve stays promised until allocated: ``max(0, reserve - blocks held
  here)``, plus incoming, is ``kv_reserved_blocks`` (nothing for a request whose sequences are all
  being copied away: their destination holds their blocks already);
* free sequence slots are ``max_num_seqs`` minus residents and queued sequences;
* a waiting prompt's ``cached_tokens`` (:func:`cached_tokens`) are looked up only for the oldest
  :data:`CACHE_LOOKUPS` prompts (placement is FIFO and each lookup walks the prompt's blocks).

``pause_s`` is the measured switch pause the policy plans with at this decision (``None``: its cost
model's), so a pause measured after start-up reaches the policy (:meth:`RoleScheduler.decide`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence as Seq
from dataclasses import dataclass, field

from node.core.batcher import Batcher
from node.core.roles import DeviceState, NodeSnapshot, ResidentSeq, Role, WaitingPrompt
from node.core.sequence import Sequence, SeqStatus

__all__ = ["CACHE_LOOKUPS", "DeviceView", "Placement", "cached_tokens", "node_snapshot", "waiting_prompt"]

CACHE_LOOKUPS = 64  # waiting prompts (oldest first) whose cached prefix a snapshot shows


@dataclass(frozen=True)
class Placement:
    """A request placed on a device: the KV blocks reserved for it at placement and its sequences
    there (finished ones are skipped)."""

    reserve_blocks: int
    seqs: Seq[Sequence]


@dataclass(frozen=True)
class DeviceView:
    """One device's raw state as a snapshot needs it.

    Attributes:
        device_id: its id (the policy's decisions name it).
        role, role_since_s: its role and when it began (s; for SWITCHING, when the switch began).
        switching_to, switch_done_s: the target role and (estimated) end of the switch's pause while
            SWITCHING, else ``None``.
        busy_until_s: end of its step in flight (s; ``now`` when idle).
        batcher: its batcher (ledger, limits, queued prompt work).
        placements: the requests placed here, including sequences being copied away.
    """

    device_id: str
    role: Role
    role_since_s: float
    switching_to: Role | None
    switch_done_s: float | None
    busy_until_s: float
    batcher: Batcher
    placements: Seq[Placement] = field(default_factory=tuple)


def cached_tokens(seqs: Seq[Sequence], batchers: Mapping[str, Batcher]) -> dict[str, int]:
    """Prompt tokens (all ``seqs``, the choices of one waiting prompt) each device's prefix cache
    holds: what placement may count as not to compute there (devices with none are left out). The key
    memo lives on the sequence, so a prompt is hashed once."""
    if not seqs:
        return {}
    out = {}
    for device_id, b in batchers.items():
        hit = len(b.cached_prefix(seqs[0])) * b.ledger.block_size
        if hit:
            out[device_id] = hit * len(seqs)
    return out


def waiting_prompt(request_id: str, seqs: Seq[Sequence], arrival_s: float, expected_per_seq: int,
                   batchers: Mapping[str, Batcher], position: int, assured_per_seq: int = 0) -> WaitingPrompt:
    """A prompt not placed yet, the ``position``-th oldest, whose ``seqs`` are its choices: its prompt
    tokens and expected output tokens count once per choice, and its cached tokens per device
    (:func:`cached_tokens`) are looked up only within the oldest :data:`CACHE_LOOKUPS`;
    ``assured_per_seq``: the output per choice stall budgets may count on (0: the expected)."""
    n = len(seqs)
    cached = cached_tokens(seqs, batchers) if position < CACHE_LOOKUPS else {}
    return WaitingPrompt(request_id, seqs[0].prompt_len * n, arrival_s, expected_per_seq * n, seqs=n,
                         cached_tokens=cached, priority=seqs[0].params.priority, assured_output_tokens=assured_per_seq)


def _leaving(p: Placement, v: DeviceView, moving: Mapping[str, str]) -> bool:
    """Every unfinished sequence of the placement is being copied away (its move begun: out of the
    batcher): its reserve is promised here no more (its destination holds its blocks already)."""
    if not moving:
        return False
    live = [s for s in p.seqs if s.status is not SeqStatus.FINISHED]
    return bool(live) and all(s.seq_id in moving and s not in v.batcher.running and s not in v.batcher.waiting
                              for s in live)


def node_snapshot(now: float, views: Iterable[DeviceView], *, moving: Mapping[str, str],
                  moved_s: Mapping[str, float], expected: Callable[[Sequence], int],
                  waiting: Iterable[WaitingPrompt] = (), pause_s: float | None = None,
                  assured: Callable[[Sequence, int], int] | None = None) -> NodeSnapshot:
    """The policies' snapshot of ``views`` at ``now`` (s) by the module docstring's rules.

    Args:
        moving: sequence id → destination device id, for moves queued or copying.
        moved_s: sequence id → end of its last move (or refusal), s: the imbalance fallback's cooldown.
        expected: a resident sequence's expected output tokens (placement's estimate).
        waiting: the prompts not placed yet, in the order the caller keeps them.
        pause_s: the measured switch pause (s) the policy plans this decision with, or ``None``.
        assured: a resident sequence's assured output tokens given the tokens it has produced
            (:meth:`node.core.output_estimate.OutputEstimator.assured`; ``None``: its expected ones).
    """
    views = list(views)
    residents: dict[str, list[ResidentSeq]] = {v.device_id: [] for v in views}
    incoming = dict.fromkeys(residents, 0)  # blocks of moves not yet applied
    queued: dict[str, tuple[int, int]] = {}
    reserved: dict[str, int] = {}
    for v in views:
        q_tokens = q_seqs = 0
        promised = 0
        for p in v.placements:
            held = 0  # blocks its sequences hold here (finished ones included: the reserve covered them)
            for s in p.seqs:
                held += len(s.block_ids)
                if s.status is SeqStatus.FINISHED:
                    continue
                # Sequence.num_output and .is_decoding inlined: this loop runs over every sequence of the
                # node at each decision round
                n = len(s.token_ids)
                out, uncomputed = n - s.prompt_len, n - s.num_computed
                if out > 0 and uncomputed == 1:  # decoding
                    dst = moving.get(s.seq_id, v.device_id) if moving else v.device_id
                    if dst not in residents:
                        continue  # leaving the node (a peer), or for a device that went down
                    on_move = s.seq_id in moving
                    residents[dst].append(ResidentSeq(s.seq_id, s.first_token_s or now, out, s.num_computed,
                                                      expected(s), now if on_move else moved_s.get(s.seq_id),
                                                      assured(s, out) if assured is not None else 0))
                    if dst != v.device_id and s in v.batcher.running:  # not begun: dst allocates later
                        incoming[dst] += len(s.block_ids)
                else:
                    q_tokens += uncomputed
                    q_seqs += 1
            if not (moving and _leaving(p, v, moving)):
                promised += max(0, p.reserve_blocks - held)
        reserved[v.device_id] = promised
        queued[v.device_id] = (q_tokens, q_seqs)
    devices = []
    for v in views:
        b, resident = v.batcher, residents[v.device_id]
        q_tokens, q_seqs = queued[v.device_id]
        pq = b.prefill_queue()
        devices.append(DeviceState(
            device_id=v.device_id, role=v.role, role_since_s=v.role_since_s, switching_to=v.switching_to,
            switch_done_s=v.switch_done_s, busy_until_s=v.busy_until_s, resident=tuple(resident),
            prefill_queue_tokens=q_tokens, prefill_queue_seqs=q_seqs, kv_free_blocks=b.ledger.num_free,
            kv_reserved_blocks=reserved.get(v.device_id, 0) + incoming[v.device_id],
            kv_total_blocks=b.ledger.num_blocks, block_size=b.ledger.block_size,
            seq_slots_free=b.config.max_num_seqs - len(resident) - q_seqs,
            prefill_queue_oldest_s=pq.oldest_arrival_s, prefill_runnable=pq.runnable))
    return NodeSnapshot(tuple(devices), tuple(waiting), pause_s=pause_s)
