"""What the node and an engine process say to each other besides steps, and the two ways a request
to an engine fails (see :mod:`node.worker.engine_process` for the channel that carries them)."""

from __future__ import annotations

import msgspec

from node.core.grammar_spec import GrammarSpec
from node.transport.protocol import Fingerprint
from node.worker.background_compile import CompileState
from node.worker.engine_core import StepMsg, StepReply


def retrieved(fut) -> None:
    """Mark an asyncio future's exception as read (a done callback): no "Future exception was never
    retrieved" error for a reply nobody awaits any more (steps in flight behind the one a dead engine's
    loop stopped at; a group's replies of ranks settled otherwise)."""
    if not fut.cancelled():
        fut.exception()


class EngineDied(RuntimeError):
    """The device's engine process is gone (crashed, killed, or its pipe closed)."""


class EngineError(RuntimeError):
    """An exception inside the engine process while it served one request; the engine goes on.
    ``kind`` is the engine-side exception's type name."""

    def __init__(self, message: str, kind: str = ""):
        super().__init__(message)
        self.kind = kind


class Prepare(msgspec.Struct, tag="prepare"):
    """Run the decode role's reconfiguration (capture graphs where they exist)."""


class GetFingerprint(msgspec.Struct, tag="fingerprint"):
    """Compute the node's handshake fingerprint from this engine's weights."""


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Ready(msgspec.Struct, tag="ready"):
    """Sent once after loading: the KV pool's geometry (its memory follows as a handle), the intra-op
    threads, and the compiled buckets (None: eager steps; :mod:`node.worker.background_compile`)."""

    num_blocks: int
    kv_shape: list[int]
    kv_dtype: str
    kv_cuda: bool
    threads: int
    compile: CompileState | None = None


class CompileStatus(msgspec.Struct, tag="compile_status"):
    """Ask for the engine's compiled buckets now (the node polls while buckets are pending and no step
    brings the news: :mod:`node.runtime.compile_watch`)."""


class CompileReply(msgspec.Struct, tag="compile"):
    """The answer to :class:`CompileStatus` (None: the engine's steps run eagerly)."""

    state: CompileState | None


class GrammarPrepare(msgspec.Struct, tag="grammar_prepare"):
    """Compile ``spec`` in the engine's compile thread if it is not compiled yet, and say whether it is
    ready; answered at once, between steps (:meth:`~node.worker.grammar_masks.GrammarMasks.prepare`).
    ``seq_id`` (a sequence arriving with output already emitted: moved, handed off, resumed): also build
    its matcher from ``emitted`` (its output token ids) in that thread, ready when the answer says so;
    the sequence's first step here takes it instead of rebuilding it."""

    spec: GrammarSpec
    seq_id: str = ""
    emitted: list[int] = []


class GrammarReady(msgspec.Struct, tag="grammar_ready"):
    """The answer to :class:`GrammarPrepare`: ``ready``, or ``error`` (it does not compile here); neither:
    still compiling (ask again); ``starting``: the engine's grammar cache is still being built (xgrammar's
    import and the vocabulary's scan, started by the first request that needs it). ``in_step``: how many
    times a step of this engine has compiled a grammar or rebuilt a matcher from emitted tokens itself
    (:attr:`~node.worker.grammar_masks.GrammarMasks.in_step`; 0 when every arrival was prepared)."""

    ready: bool
    error: str = ""
    starting: bool = False
    in_step: int = 0


def answer_grammar(grammars, msg: GrammarPrepare) -> GrammarReady:
    """An engine's answer to ``msg`` from its :class:`~node.worker.grammar_masks.GrammarMasks` (between
    steps, in the thread that runs them; never waits for a compile)."""
    ready, error = grammars.prepare(msg.spec, msg.seq_id, msg.emitted)
    return GrammarReady(ready, error, starting=not grammars.started, in_step=grammars.in_step)


class Value(msgspec.Struct, tag="value"):
    value: float


class FingerprintReply(msgspec.Struct, tag="fp"):
    fingerprint: Fingerprint


class Failed(msgspec.Struct, tag="failed"):
    """An exception in the engine: its type name, message and traceback (for the node's log)."""

    kind: str
    message: str
    trace: str


class StepAck(msgspec.Struct, tag="ack"):
    """A step's reply from a tensor-parallel rank other than 0: the token ids it sampled, one per
    item in item order (-1: the item did not sample), so the node can check the ranks agree; the
    outputs (logprobs) are rank 0's alone."""

    tokens: list[int]
    busy_s: float = 0.0


class TPRank(msgspec.Struct, frozen=True):
    """An engine's place in a tensor-parallel group: ``rank`` of ``degree``, joining the group's own
    ``torch.distributed`` world through ``init_method`` (``file://...``). ``prefill_degree``: a
    time-shared group (``--prefill-tp``; :mod:`node.worker.role_layouts`), 0 otherwise."""

    rank: int
    degree: int
    init_method: str
    group: str  # the group's device id (cpu:0+cpu:1), for logs
    prefill_degree: int = 0


class PeerPools(msgspec.Struct, tag="pools"):
    """Map the KV pools of ``ranks`` (this rank's column of a time-shared group) into the engine: one
    handle per rank other than the engine's own follows on the pipe, in order (the pool's memfd over
    ``SCM_RIGHTS`` on the CPU, its CUDA IPC handle on GPUs)."""

    ranks: list[int]


class Reconfigure(msgspec.Struct, tag="reconfigure"):
    """Make ``role``'s layout active (a time-shared group's switch; :meth:`GroupLayouts.activate`)."""

    role: str


Request = StepMsg | Prepare | GetFingerprint | Shutdown | PeerPools | Reconfigure | CompileStatus | GrammarPrepare
Reply = StepReply | StepAck | Ready | Value | FingerprintReply | Failed | CompileReply | GrammarReady

TP_TIMEOUT_S = 300.0  # a collective of a tensor-parallel group waits this long for a rank that never joins
