"""What the role policies (:mod:`node.core.roles`, :mod:`node.core.adaptive`) read and return: the
node's snapshot (each device's role, resident sequences and room; the waiting prompts), the decisions
(:class:`SwitchRole`, :class:`Place`, :class:`Reject`, and :class:`Migrate`: a sequence's move between
devices) and the policy's targets and knobs (:class:`RoleSchedulerConfig`). Pure: the standard library
and msgspec only."""

from __future__ import annotations

import enum
import math

import msgspec

INF = math.inf
DECODE_LOAD_WEIGHT = 1.0  # weight of a placement's expected decode time against its prefill end (Dynamo's 1:1)
EPS = 1e-9  # s; float slack in time comparisons


class Role(enum.Enum):
    """A device's role. ``MIXED`` (the adaptive policy, :mod:`node.core.adaptive`) runs the resident
    decode batch plus prompt chunks in the decode configuration; the two-role policy never uses it."""

    PREFILL = "prefill"
    DECODE = "decode"
    SWITCHING = "switching"
    MIXED = "mixed"


class WaitingPrompt(msgspec.Struct, frozen=True):
    """A prompt not yet placed on a device. ``arrival_s`` on the policy clock (s).

    ``cached_tokens``: device id → prompt tokens (all its sequences) that device's prefix cache holds
    now, which it would not compute (absent: none).
    """

    request_id: str
    prompt_tokens: int
    arrival_s: float
    expected_output_tokens: int
    seqs: int = 1  # sequences the prompt becomes (its ``n`` choices); each takes a sequence slot
    cached_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    priority: int = 0  # lower first (--scheduling-policy priority; node.core.priority)
    # output tokens per sequence it reaches with high probability, what stall budgets may count on
    # (node.core.output_estimate.OutputEstimator.assured; 0: the expected per sequence)
    assured_output_tokens: int = 0

    def order_key(self) -> tuple[int, float, str]:
        """Placement order: priority (lower first), then arrival, then request id."""
        return (self.priority, self.arrival_s, self.request_id)

    def new_tokens(self, device_id: str) -> int:
        """Prompt tokens the device would compute: those its prefix cache does not hold."""
        return max(0, self.prompt_tokens - self.cached_tokens.get(device_id, 0))


class ResidentSeq(msgspec.Struct, frozen=True):
    """A prefilled sequence whose KV lives on the device (it decodes when the device does).

    ``first_token_s``: when its first token came (s); ``output_tokens``: tokens generated so far,
    the first included; ``context_tokens``: prompt + output tokens cached; ``expected_output_tokens``:
    the placement's estimate of its final output length (0: unknown); ``assured_output_tokens``: the
    length it reaches with high probability, which stall budgets count on
    (:meth:`node.core.output_estimate.OutputEstimator.assured`; 0: the expected); ``request_id``: the id the
    policy's decisions name it by (the node passes the sequence id, ``{request id}-{choice}``);
    ``moved_s``: when it last moved between devices, or a move of it was last refused (s), read by the
    imbalance fallback's cooldown (:mod:`node.core.imbalance`).
    """

    request_id: str
    first_token_s: float
    output_tokens: int
    context_tokens: int
    expected_output_tokens: int = 0
    moved_s: float | None = None
    assured_output_tokens: int = 0


class DeviceState(msgspec.Struct, frozen=True, kw_only=True):
    """One device as the policy sees it.

    Attributes:
        role, role_since_s: current role and when it began (s; for SWITCHING, when the switch began).
        switching_to, switch_done_s: target role and end of the pause while SWITCHING.
        busy_until_s: end of the step in flight (s; ``<= now`` when idle).
        resident: decoding sequences held here.
        prefill_queue_tokens, prefill_queue_seqs: prompt tokens (and prompts) placed here and not yet
            fully prefilled, the step in flight included.
        kv_free_blocks: blocks an allocation may take: unreferenced ones, cached (reclaimable) included.
        kv_reserved_blocks: blocks promised to work already here but not yet allocated (the rest of
            each placed prompt's and resident sequence's :func:`reserve_blocks`).
        seq_slots_free: sequences the device can still hold (its batch cap); a prompt is placed only
            where its sequences fit, so placed work can always run.
        prefill_queue_oldest_s: arrival of the oldest queued prompt work here (s; ``None``: none).
        prefill_runnable: a PREFILL step could make progress on the queued work now (its head fits
            the free blocks and a sequence slot). False for work that waits on resident sequences
            giving back blocks, e.g. a sequence preempted for lack of KV: the residents must decode.
    """

    device_id: str
    role: Role
    role_since_s: float = 0.0
    switching_to: Role | None = None
    switch_done_s: float | None = None
    busy_until_s: float = 0.0
    resident: tuple[ResidentSeq, ...] = ()
    prefill_queue_tokens: int = 0
    prefill_queue_seqs: int = 0
    kv_free_blocks: int = 0
    kv_reserved_blocks: int = 0
    kv_total_blocks: int = 0
    seq_slots_free: int = 1 << 30  # sequences the device may still take (its max_num_seqs minus held and queued)
    block_size: int = 16
    prefill_queue_oldest_s: float | None = None
    prefill_runnable: bool = True


class NodeSnapshot(msgspec.Struct, frozen=True):
    """Devices (in a fixed order: it breaks ties) and the prompts waiting for placement.

    ``pause_s``: the switch pause measured so far (s), which the policy plans this decision with
    (at least ``reconfig_pause_ms``); ``None``: its cost model's ``pause_s``.
    """

    devices: tuple[DeviceState, ...]
    waiting: tuple[WaitingPrompt, ...] = ()
    pause_s: float | None = None


class SwitchRole(msgspec.Struct, frozen=True, tag="switch"):
    """Start a switch of ``device_id`` to ``to_role`` (it pauses, then takes the role).

    ``window_s``/``window_tokens``: planned prefill window (s, prompt tokens); 0 for DECODE.
    ``reason``: queue | recompute | ttft | idle | park | drained | window | blocked; the adaptive policy
    (:mod:`node.core.adaptive`) adds cheaper | no_chunk_fits | handoff (to PREFILL; handoff:
    :mod:`node.core.handoff_windows`), chunks_fit (to MIXED), nothing_waits | no_headroom | gather | spacing (to
    DECODE from MIXED).
    """

    device_id: str
    to_role: Role
    reason: str
    window_s: float = 0.0
    window_tokens: int = 0


class Place(msgspec.Struct, frozen=True, tag="place"):
    """Route a waiting prompt to a prefill-role device, reserving ``reserve_blocks`` KV blocks."""

    request_id: str
    device_id: str
    reserve_blocks: int


class Reject(msgspec.Struct, frozen=True, tag="reject"):
    """Refuse a prompt that no device could hold even when empty."""

    request_id: str
    reason: str


Decision = SwitchRole | Place | Reject


class Migrate(msgspec.Struct, frozen=True, tag="migrate"):
    """Move decoding sequence ``seq_id`` (the ``ResidentSeq`` id) from ``src_device`` to ``dst_device``.

    ``reason``: ``tpot`` (a prefill window would make it miss its target) or ``imbalance``; the adaptive
    policy's hand-off windows give ``handoff`` (:mod:`node.core.handoff_windows`). Decided by the imbalance
    fallback (:mod:`node.core.imbalance`) and by those windows.
    """

    seq_id: str
    src_device: str
    dst_device: str
    reason: str


class RoleSchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Targets and knobs (ms, tokens). See the module docstring for how each enters the policy."""

    ttft_slo_ms: float = 1000.0
    tpot_slo_ms: float = 100.0
    reconfig_pause_ms: float = 0.0
    min_window_ms: float = 20.0
    max_window_ms: float = 500.0
    prefill_token_budget: int = 2048
    slo_margin: float = 0.9
    ttft_urgency: float = 0.5
    max_pause_share: float = 0.2
    stagger: str = "soft"  # hard | soft | off
    copy_s_per_token: float = 0.0  # s per context token of KV copied between devices: KV bytes * 8 / link bit/s; 0: free


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks holding ``tokens`` tokens: ``ceil(tokens / block_size)``."""
    return -(-max(0, tokens) // block_size)


def reserve_blocks(prompt_tokens: int, expected_output_tokens: int, block_size: int, total_blocks: int) -> int:
    """KV blocks a prompt reserves when placed: prompt plus expected output, at most the device."""
    return min(blocks_for(prompt_tokens + max(1, expected_output_tokens), block_size), total_blocks)


def assured_output(r: ResidentSeq) -> int:
    """The output tokens a stall budget may count on for resident ``r``: its assured length, else its
    expected one (0: unknown)."""
    return r.assured_output_tokens or r.expected_output_tokens


def assured_per_seq(w: WaitingPrompt) -> int:
    """The output tokens per sequence a stall budget may count on for waiting prompt ``w``: its assured
    length, else its expected output per sequence."""
    return w.assured_output_tokens or w.expected_output_tokens // max(1, w.seqs)


def move_blocks(s: ResidentSeq, dst: DeviceState) -> int:
    """Free blocks a device must have to take resident ``s`` from another: its next token at least,
    and its expected rest ``expected - output`` (at most the device's pool)."""
    rest = max(1, s.expected_output_tokens - s.output_tokens)
    low = blocks_for(s.context_tokens + 1, dst.block_size)
    return max(low, min(blocks_for(s.context_tokens + rest, dst.block_size), dst.kv_total_blocks))


def urgent_at(w: WaitingPrompt, now_s: float, pause_s: float, prefill_s: float, ttft_urgency: float,
              ttft_slo_ms: float) -> bool:
    """Whether a waiting prompt is *urgent*: its age at ``now_s`` plus the switch pause and its prefill
    ``prefill_s`` (all s) reach ``ttft_urgency`` of the TTFT SLO (``ttft_slo_ms``, ms). The role scheduler
    forces windows for such prompts; the imbalance fallback makes no local tpot move while one waits."""
    return now_s - w.arrival_s + pause_s + prefill_s >= ttft_urgency * ttft_slo_ms / 1e3
