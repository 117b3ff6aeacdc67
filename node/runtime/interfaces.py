"""The narrow views of the node that its services are handed, as typing Protocols.

The node (:class:`node.runtime.node.Node`) is the composition root: it builds the engines, the driver, the
peer links, the KV receiver, the metrics and the health check, and hands each the node itself typed as
the one view below that it needs. So a service sees only what it may use, and none of them imports
``node.runtime.node`` (imports go one way: ``node`` → services → these views → engines; a test walks
``node/`` for cycles, type-only imports included). The node satisfies every view structurally; a unit
test can hand a service a small fake instead.

Which service takes which view:

* :class:`PeerHost`: the peer links, the KV receiver and a hand-off (:mod:`node.runtime.peer_links`,
  :mod:`node.runtime.kv_receiver`, :mod:`node.runtime.handoff`);
* :class:`DriverHost`: the placement drivers (:mod:`node.runtime.driver`, ``role_driver``, ``pooled_driver``);
* :class:`StateSource`: what ``/health`` and the metrics collectors read at request or scrape time
  (:mod:`node.runtime.health`, :mod:`node.runtime.metrics`, :mod:`node.runtime.vllm_metrics`).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Protocol

from node.config import NodeConfig
from node.core.sequence import Sequence
from node.runtime.engine import DeviceEngine
from node.runtime.moves import MigrationRecord
from node.runtime.peer_state import InboundRefusals, Peer
from node.runtime.request import RequestState
from node.worker.loader import LoadedModel


class EngineSet(Protocol):
    """The node's devices, each a :class:`DeviceEngine` (a tensor-parallel group counts as one)."""

    engines: list[DeviceEngine]

    def engine(self, device_id: str) -> DeviceEngine:
        """The engine of ``device_id``. Raises ``KeyError`` for an unknown id."""
        ...

    def least_loaded(self, device_ids: list[str] | None = None) -> DeviceEngine:
        """The device (of ``device_ids``, default all) with the fewest queued, then resident, sequences."""
        ...


class PeerPlacement(Protocol):
    """What the peer links need of the node's placement driver."""

    def kick(self) -> None:
        """Re-run placement soon (something it waits for changed)."""
        ...

    def reserved_on(self, device_id: str) -> int:
        """Blocks promised on ``device_id`` to its requests and not yet allocated there."""
        ...

    def recompute(self, req: RequestState, index: int) -> None:
        """Prefill choice ``index`` of ``req`` again on a local device (its peer hand-off broke)."""
        ...


class PeerHost(EngineSet, Protocol):
    """What the peer links, the KV receiver and a hand-off use of the node."""

    config: NodeConfig
    max_model_len: int
    tokenizer: Any  # node.worker.tokenizer.Tokenizer
    metrics: Any  # node.runtime.metrics.NodeMetrics (counters and histograms by attribute)
    driver: PeerPlacement | None

    def eos_ids(self) -> list[int]:
        """Token ids that end a sequence (the tokenizer's, else the model config's)."""
        ...

    def record_migration(self, src: str, dst: str, record: MigrationRecord) -> None:
        """Count and keep one sequence's KV move."""
        ...


class PeerTable(Protocol):
    """What the drivers, ``/health`` and the metrics read of the node's peer links
    (:class:`~node.runtime.peer_links.PeerLinks`)."""

    peers: dict[str, Peer]  # by address
    stale_s: float  # a peer unheard of for this long (s) is not used
    sending: dict[str, str]  # sequence id → its source device, while its hand-off is not settled
    retries: dict[str, int]

    def ready(self, now: float) -> list[Peer]:
        """Peers that may take a sequence now (``now``: monotonic s)."""
        ...

    def healthy(self, now: float) -> list[Peer]:
        """Peers connected and heard of recently."""
        ...

    def unusable(self, now: float) -> tuple[str, str]:
        """Why no peer can take a sequence: ``(error code, message)``."""
        ...

    def hand_off(self, engine: DeviceEngine, req: RequestState, seq: Sequence, peer: Peer, reason: str,
                 settled: Callable[[bool], None] | None = None) -> asyncio.Task:
        """Start moving decoding ``seq`` from ``engine`` to ``peer``."""
        ...

    def cancel(self, request_id: str) -> None:
        """Stop ``request_id``'s hand-offs and relays."""
        ...


class Inbound(Protocol):
    """What ``/health``, ``/v1/node`` and the metrics read of the KV receiver
    (:class:`~node.runtime.kv_receiver.KVReceiver`)."""

    refused: InboundRefusals
    incoming: dict  # transfer id → (engine, blocks, reused), while a peer's transfer is under way
    relayed: int  # sequences received and decoded here for a peer

    @property
    def port(self) -> int:
        """The TCP port the receiver listens on."""
        ...


class DriverHost(EngineSet, Protocol):
    """What the placement drivers use of the node."""

    config: NodeConfig
    info: LoadedModel
    metrics: Any  # node.runtime.metrics.NodeMetrics
    peers: PeerTable | None
    draining: bool
    supervisor: Any  # node.runtime.engine_supervisor.EngineSupervisor: coming_back(device_id)


class StateSource(EngineSet, Protocol):
    """What ``/health`` and the metrics collectors read of the node, at request or scrape time."""

    config: NodeConfig
    peers: PeerTable | None
    receiver: Inbound | None
    driver: Any  # the placement driver, or None (colocated); read by attribute where present
    draining: bool
    api_down: dict[int, str]  # --api-processes > 1: front ends that exited, by index (node.api.frontend_link)
    live: dict[str, RequestState]
    supervisor: Any  # node.runtime.engine_supervisor.EngineSupervisor (restarts); read with getattr

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for a device (``--max-queue`` bounds it)."""
        ...

    def oldest_request_age_s(self, now_s: float) -> float:
        """Age (s) of the oldest admitted, unfinished request; 0 with none."""
        ...

    def role_of(self, e: DeviceEngine, decoders: list[str] | None = None) -> str:
        """What device ``e`` does now: prefill, decode, switching or mixed."""
        ...


class ApiNode(Protocol):
    """What the HTTP API (:mod:`node.api`) uses of the node: admission, a request's life, and the pages
    about the node. Only the app factory (:mod:`node.api.app`) and the CLI know the concrete ``Node``."""

    config: NodeConfig
    info: LoadedModel
    tokenizer: Any  # node.worker.tokenizer.Tokenizer
    max_model_len: int
    metrics: Any  # node.runtime.metrics.NodeMetrics: render()
    peers: Any  # node.runtime.peer_links.PeerLinks or None: add() / remove()
    started_wall_s: float
    api_pids: list[int]  # --api-processes > 1: the front ends' pids (GET /v1/node)
    api_down: dict[int, str]  # --api-processes > 1: front ends that exited and are being restarted

    def new_request_id(self, prefix: str) -> str:
        """A fresh request id (``cmpl-…``, ``chatcmpl-…``)."""
        ...

    def check_admission(self, new: int) -> None:
        """Raise a :class:`~node.runtime.admission.QueueFullError` (503) if ``new`` requests may not queue now."""
        ...

    def open_request(self, request_id: str, prompt_ids: list[int], params: Any, n: int = 1, *,
                     stream: Any = None, index0: int = 0, detokenize: bool = True) -> RequestState:
        """Admit one request (raises the admission errors); ``detokenize=False``: token ids only (an API
        front end makes the text)."""
        ...

    def account(self, req: RequestState, delta: Any, now: float) -> None:
        """Count a delta the client took at ``now`` (TTFT, ITL, TPOT, tokens)."""
        ...

    def close_request(self, req: RequestState) -> None:
        """The client is done with ``req``: free what it holds. Idempotent."""
        ...

    def drain(self) -> int:
        """Stop taking requests and move decoding sequences to the peers."""
        ...

    def status(self, history: int = 200, since_s: float | None = None) -> dict:
        """``GET /v1/node``."""
        ...
