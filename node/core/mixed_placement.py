"""Placing waiting prompts on the adaptive policy's decode-configuration devices, as chunks (pure).

Symbols as in :mod:`node.core.adaptive`; a part of :class:`node.core.adaptive.AdaptiveScheduler` (its
``mixed``), given by its constructor the estimates it uses of the policy: the TTFT target, the KV fit,
the time of a queue as chunks, the decode step time and urgency; it reads each device's ``mix`` (chunk
``c``, work start ``t0``, residents ``s`` holding ``k`` tokens) and holds no state of its own. Prompts go
FIFO to the device where their chunked prefill ends soonest, plus their expected decode there (the two-role
placement's cost), within the TTFT target; an urgent prompt that fits nowhere holds back the rest, unless
only KV blocks or sequence slots bind it, in which case it reserves them (:meth:`MixedPlacement._reserve`)
and the rest pass beside the reservation.
"""

from __future__ import annotations

from typing import Any, Callable

from node.core.role_state import DeviceState
from node.core.roles import EPS, DECODE_LOAD_WEIGHT, Place, WaitingPrompt, _Dev

__all__ = ["MixedPlacement"]


class MixedPlacement:
    """The chunk placement of the adaptive policy (stateless: every input comes with the call or from
    the estimates below, read at each call, so a refit cost model is seen at once).

    Args:
        target_s: returns the TTFT target ``ttft_urgency x ttft_slo`` (s) a device's queue must end within.
        fits_kv: blocks a prompt reserves on a device, or -1 when its free KV or sequence slots cannot
            take it (``RoleScheduler._fits_kv``).
        need_blocks: blocks a prompt reserves on a device state, or -1 if it cannot fit even an empty
            device (``RoleScheduler._need_blocks``).
        chunks_s: seconds from a device's ``t0`` until ``tokens`` prompt tokens are carried in its chunks
            (``AdaptiveScheduler._chunks_s``).
        decode_step_s: the decode step time (s) of ``n`` sequences holding ``k`` context tokens.
        urgent: whether a waiting prompt is urgent at ``now_s`` (``WindowMath.urgent``).
    """

    def __init__(self, *, target_s: Callable[[], float], fits_kv: Callable[[_Dev, WaitingPrompt], int],
                 need_blocks: Callable[[DeviceState, WaitingPrompt], int], chunks_s: Callable[[Any, int], float],
                 decode_step_s: Callable[[int, int], float], urgent: Callable[[WaitingPrompt, float], bool]):
        self._target_s, self._fits_kv, self._need_blocks = target_s, fits_kv, need_blocks
        self._chunks_s, self._decode_step_s, self._urgent = chunks_s, decode_step_s, urgent

    def _reserve(self, w: WaitingPrompt, devs: list[_Dev], mixes: dict) -> bool:
        """Reserve an urgent prompt's KV blocks and slots on the mixing device that lacks the fewest blocks
        for it (it fits none now): that device takes no later prompt until its residents have freed them,
        so prompts that fit elsewhere pass the head without delaying it. False where no device could
        hold it even empty."""
        fit = [(max(0, need - dv.kv), dv.idx, dv, need) for dv in devs
               if mixes[dv.st.device_id].chunk > 0 and (need := self._need_blocks(dv.st, w)) >= 0]
        if not fit:
            return False
        _, _, dv, need = min(fit, key=lambda x: x[:2])
        dv.kv, dv.slots = dv.kv - need, dv.slots - w.seqs
        return True

    def place(self, now_s: float, waiting: list[WaitingPrompt], devs: list[_Dev], mixes: dict,
                     out: list[Place]) -> tuple[list[WaitingPrompt], int]:
        """Place prompts FIFO on decode-configuration devices with a positive chunk budget: where they
        fit KV and slots and their chunked prefill ends within the TTFT target (one prompt at least on
        an empty queue), least finish plus expected decode first; return those left waiting, and the
        prompt tokens of those among them that some device had the KV and slots for (not the time).
        An urgent prompt left waiting holds back every later one, unless only KV or slots bind it: then
        its blocks are reserved (:meth:`_reserve`) and later prompts that fit beside the reservation pass."""
        left: list[WaitingPrompt] = []
        capped = 0
        target_s = self._target_s()
        blocked = False
        for w in waiting:
            best: tuple[float, int, _Dev, int] | None = None
            room = False
            if not blocked:
                for dv in devs:
                    mix = mixes[dv.st.device_id]
                    need = self._fits_kv(dv, w)
                    if need < 0 or mix.chunk <= 0:
                        continue
                    new = w.new_tokens(dv.st.device_id)
                    finish = mix.t0 + self._chunks_s(mix, dv.q + new)
                    room = True
                    if dv.q > 0 and finish - now_s > target_s + EPS:
                        continue
                    n = mix.s + dv.qn + w.seqs
                    decode = self._decode_step_s(n, mix.k + dv.q + w.prompt_tokens + n)
                    cost = finish + DECODE_LOAD_WEIGHT * max(1, w.expected_output_tokens // max(1, w.seqs)) * decode
                    if best is None or (cost, dv.idx) < best[:2]:
                        best = (cost, dv.idx, dv, need)
            if best is None:
                left.append(w)
                capped += w.prompt_tokens if room else 0
                if not blocked and self._urgent(w, now_s):  # an urgent head: later prompts must not delay it
                    blocked = room or not self._reserve(w, devs, mixes)  # only KV or slots bind it: reserve them
                continue
            _, _, dv, need = best
            out.append(dv.take(w, need))
            mix = mixes[dv.st.device_id]
            mix.oldest_s = w.arrival_s if mix.oldest_s is None else min(mix.oldest_s, w.arrival_s)
        return left, capped

