"""Router and admission of pooled (disaggregated) mode: fixed prefill devices, fixed decode devices.

The first arrangement of the seed note: a prompt is prefilled on a prefill device, its KV is handed to
a decode device, and decode runs there. Placement is two-sided and decided at once, per waiting prompt
in (arrival, request id) order:

* **decode side first** — the decode device with the most free KV after reservations that can hold
  the prompt plus its expected output (``reserve_blocks``) and has free sequence slots. Its blocks are
  *reserved* now, before the cache exists, so a finished prefill always has somewhere to go (the
  seed: "decode workers must reserve capacity before the cache lands"; the output estimate is an
  admission decision);
* **prefill side** — the prefill device with the fewest queued prompt tokens (compute availability)
  whose KV holds the prompt and whose prompts in flight plus finished-but-unsent caches stay under
  ``max_unsent_per_device`` (stranded state is bounded). A request of more sequences (``n``) than the
  bound goes to a device with nothing in flight, so it waits its turn instead of never being placed.

**Following the prefix cache** (each waiting prompt carries, per device, the prompt tokens its prefix
cache holds: ``WaitingPrompt.cached_tokens``). Among the devices that can take it, the prompt goes to
the one of least cost, NVIDIA Dynamo's KV-router rule (``overlap_weight * prefill_blocks +
active_blocks``) with weight 1 on each side's own resource:

* decode side: ``cost = (prompt blocks - cached blocks there) - free blocks after reservations`` —
  blocks it must receive (the cached prefix is reused in place, only the rest is sent) against the
  room it has, in blocks (with no cache: the roomiest device, as before);
* prefill side: ``cost = queued tokens + outgoing tokens + (prompt - cached tokens there)`` — prompt
  tokens it must compute before this one is done, plus the KV its link must still send, one token
  for one token (with no cache: the least queued device whose link is least backed up).

So a prefix draws its conversation to the device that holds it until that device is busier than the
others by more than what the cache saves. Ties: snapshot order.

A prompt that no pair can take waits (so do all prompts while either pool is empty, e.g. every decode
peer unreachable) (the shell bounds the queue and answers 503 past ``--max-queue``);
a later prompt does not overtake it (FIFO), so backpressure from a saturated decode pool reaches the
clients as queueing instead of as prefill work that cannot be handed off. A prompt that could not fit
an empty pair is rejected.

Pure: standard library and msgspec only.
"""

from __future__ import annotations

import msgspec

from node.core.roles import Reject, WaitingPrompt, blocks_for, reserve_blocks


class PoolDevice(msgspec.Struct, frozen=True, kw_only=True):
    """One device of a pool as the router sees it (blocks and sequences, no time).

    ``inflight_seqs`` counts prompts placed and not yet handed off (queued, prefilling, or prefilled
    and waiting for their transfer) on a prefill device; ``kv_reserved_blocks`` the blocks promised to
    placed work and not yet allocated; ``seq_slots_free`` sequences it may still take;
    ``outgoing_tokens`` the tokens of KV queued to leave a prefill device or leaving it now (the backlog
    of its link: with copies that overlap prefill, a device can be idle while its link is not).
    """

    device_id: str
    kv_free_blocks: int
    kv_reserved_blocks: int = 0
    kv_total_blocks: int
    block_size: int = 16
    queued_tokens: int = 0
    inflight_seqs: int = 0
    seq_slots_free: int = 1 << 30
    outgoing_tokens: int = 0


class PoolSnapshot(msgspec.Struct, frozen=True):
    prefill: tuple[PoolDevice, ...]
    decode: tuple[PoolDevice, ...]
    waiting: tuple[WaitingPrompt, ...] = ()


class PlacePooled(msgspec.Struct, frozen=True, tag="place_pooled"):
    """Prefill ``request_id`` on ``prefill_device``, then hand it to ``decode_device``, where
    ``decode_blocks`` are reserved from now on."""

    request_id: str
    prefill_device: str
    decode_device: str
    prefill_blocks: int
    decode_blocks: int


class PooledRouter:
    """Two-sided placement for pooled mode (see the module docstring)."""

    def __init__(self, max_unsent_per_device: int):
        if max_unsent_per_device < 1:
            raise ValueError("max_unsent_per_device must be at least 1")
        self.max_unsent = max_unsent_per_device

    def decide(self, snapshot: PoolSnapshot) -> list[PlacePooled | Reject]:
        prefill = {d.device_id: [d.kv_free_blocks - d.kv_reserved_blocks, d.queued_tokens, d.inflight_seqs]
                   for d in snapshot.prefill}
        decode = {d.device_id: [d.kv_free_blocks - d.kv_reserved_blocks, d.seq_slots_free] for d in snapshot.decode}
        out: list[PlacePooled | Reject] = []
        if not snapshot.prefill or not snapshot.decode:
            return out  # a pool is unreachable for now (a decode peer down): prompts wait, the shell bounds it
        for w in snapshot.waiting:
            dec_need = {d.device_id: reserve_blocks(w.prompt_tokens, w.expected_output_tokens, d.block_size, d.kv_total_blocks)
                        for d in snapshot.decode}
            pre_need = {d.device_id: blocks_for(w.prompt_tokens + w.seqs, d.block_size) for d in snapshot.prefill}
            if not any(blocks_for(w.prompt_tokens + 1, d.block_size) <= dec_need[d.device_id] for d in snapshot.decode) or \
                    not any(pre_need[d.device_id] <= d.kv_total_blocks for d in snapshot.prefill):
                out.append(Reject(w.request_id, "prompt does not fit the KV memory of any device"))
                continue
            dec = [d for d in snapshot.decode
                   if dec_need[d.device_id] <= decode[d.device_id][0] and w.seqs <= decode[d.device_id][1]]
            pre = [d for d in snapshot.prefill
                   if pre_need[d.device_id] <= prefill[d.device_id][0]
                   and (prefill[d.device_id][2] + w.seqs <= self.max_unsent or prefill[d.device_id][2] == 0)]
            if not dec or not pre:
                break  # FIFO: later prompts wait behind this one
            d_best = min(dec, key=lambda d: (
                dec_need[d.device_id] - w.cached_tokens.get(d.device_id, 0) // w.seqs // d.block_size
                - decode[d.device_id][0], snapshot.decode.index(d)))
            p_best = min(pre, key=lambda d: (prefill[d.device_id][1] + d.outgoing_tokens + w.new_tokens(d.device_id),
                                             snapshot.prefill.index(d)))
            out.append(PlacePooled(w.request_id, p_best.device_id, d_best.device_id,
                                   pre_need[p_best.device_id], dec_need[d_best.device_id]))
            decode[d_best.device_id][0] -= dec_need[d_best.device_id]
            decode[d_best.device_id][1] -= w.seqs
            p = prefill[p_best.device_id]
            p[0] -= pre_need[p_best.device_id]
            p[1] += w.new_tokens(p_best.device_id)
            p[2] += w.seqs
        return out
