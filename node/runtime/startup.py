"""Starting a node's devices: load the model's metadata, check the tensor-parallel degrees, start each
device's engine (processes, or threads with ``--engine-layout thread``) and build its
:class:`~node.runtime.engine.DeviceEngine` (block ledger, batcher, role state and role configurations)."""

from __future__ import annotations

import asyncio
import time

import structlog

from node.config import NodeConfig, group_id
from node.core.batcher import BatchConfig, Batcher
from node.core.ledger import BlockLedger
from node.core.roles import Role
from node.runtime.engine import DeviceEngine
from node.runtime.spec_decode import SpecDecoding
from node.runtime.switching import DeviceRole
from node.transport.protocol import Fingerprint
from node.worker.engine_core import EngineCore
from node.worker.grammar_masks import GrammarMasks
from node.worker.engine_group import launch_engine
from node.worker.draft_model import build_draft_model, check_draft_model
from node.worker.engine_process import EngineProcess
from node.worker.local_engine import LocalEngine
from node.worker.loader import LoadedModel, StartupError, build_runner, load_model_info, select_ops

log = structlog.get_logger("shiftnode.node")


def check_tensor_parallel(config: NodeConfig, info: LoadedModel) -> None:
    """Refuse tensor-parallel degrees (``--tensor-parallel-size``, ``--decode-tp``, ``--prefill-tp``) the other flags (:meth:`NodeConfig.tensor_parallel_error`)
    or the model (heads, KV heads, intermediate size not divisible by it) cannot run with.

    Raises:
        StartupError: the message names the flag or the model's numbers.
    """
    problem = config.tensor_parallel_error()
    if problem:
        raise StartupError(problem)
    check_tp_degrees(config, info.cfg)


def check_tp_degrees(config: NodeConfig, cfg) -> None:
    """Refuse tensor-parallel degrees the model ``cfg`` (a :class:`ModelConfig`) cannot split into.

    Raises:
        StartupError: naming the flag and the model's numbers.
    """
    from node.worker.tensor_parallel import TensorParallelError, check_tp_config

    for flag, degree in (("--tensor-parallel-size", config.tensor_parallel_size), ("--decode-tp", config.decode_tp),
                         ("--prefill-tp", config.prefill_tp)):
        if degree > 1:
            try:
                check_tp_config(cfg, degree)
            except TensorParallelError as e:
                raise StartupError(f"{flag} {degree}: {e}") from e


async def load_engines(config: NodeConfig, prelaunched: dict[str, EngineProcess] | None,
                       networked: bool) -> tuple[LoadedModel, list[DeviceEngine], Fingerprint | None]:
    """Start every device's engine and build its :class:`DeviceEngine` (see :meth:`Node.create
    <node.runtime.node.Node.create>`); with ``networked`` also hash the model's fingerprint, off the event
    loop. Engines already started are stopped again if any fails.

    Raises:
        StartupError: an engine failed to load or died while loading; a tensor-parallel degree the flags
            or the model cannot run with; a draft model (``--speculative-config``) the target cannot verify.
    """
    prelaunched = dict(prelaunched or {})
    loop = asyncio.get_running_loop()
    handles: list = []
    groups = config.device_groups()
    ids = [group_id(g) for g in groups]
    try:
        info = load_model_info(config)
        check_tensor_parallel(config, info)
        check_draft_model(config, info)  # --speculative-config's draft model: its vocabulary is the target's
        if config.engine_layout == "thread":
            for device_id in config.devices:
                ops = select_ops(config.attention_backend, device_id.partition(":")[0])
                runner = await loop.run_in_executor(None, build_runner, config, info, device_id, ops)
                draft = None
                if config.speculative_config is not None and config.speculative_config.uses_draft_model:
                    draft = await loop.run_in_executor(None, build_draft_model, config, info, device_id, ops,
                                                       runner.num_blocks)
                core = EngineCore(runner, grammars=GrammarMasks.for_model(info), draft=draft)
                await loop.run_in_executor(None, core.warm_up)
                handles.append(LocalEngine(core))
        else:
            handles = [prelaunched.pop(i, None) or launch_engine(config, g) for i, g in zip(ids, groups)]
            results = await asyncio.gather(*(loop.run_in_executor(None, h.wait_ready) for h in handles),
                                           return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                raise StartupError(str(failed[0])) from failed[0]
            for h in handles:  # from now on this loop reads and writes the engines' sockets
                h.attach(loop)
    except BaseException:
        for h in handles + list(prelaunched.values()):
            await loop.run_in_executor(None, h.stop)
        raise
    for h in prelaunched.values():  # forked for devices this config does not use (not expected)
        h.stop()
    engines = []
    roles = {Role(name): rc for name, rc in config.role_configs().items()} if config.role_policy else {}
    prefillers = config.prefill_group_ids()
    for device_id, runner in zip(ids, handles):
        ledger = BlockLedger(runner.num_blocks, config.block_size, prefix_caching=config.prefix_caching)
        batcher = Batcher(ledger, BatchConfig(
            max_num_seqs=config.max_num_seqs,
            max_batched_tokens=config.max_num_batched_tokens,
        ))
        role = None
        if config.mode == "time-shared":  # devices start parked in PREFILL (nothing resident yet)
            role = DeviceRole(device_id, Role.PREFILL, time.monotonic(), config.reconfig_pause_ms / 1e3)
        elif config.mode == "adaptive":  # in the decode configuration, where a prompt costs no pause
            role = DeviceRole(device_id, Role.DECODE, time.monotonic(), config.reconfig_pause_ms / 1e3)
        elif config.mode == "pooled" and device_id in prefillers:  # prompt-only steps, always
            role = DeviceRole(device_id, Role.PREFILL, time.monotonic(), 0.0)
        # Pooled decode devices get no role: they decode, and recompute a sequence that an
        # underestimated output forced them to preempt (vLLM's recompute), in mixed steps.
        engine = DeviceEngine(device_id, runner, batcher, time.monotonic, role)
        if config.speculative_config is not None:  # node.runtime.spec_decode
            engine.spec = SpecDecoding(config.speculative_config, batcher, engine._encoder)
        if roles:  # time-shared: each role's limits and layout (node.core.role_config)
            engine.configure_roles(roles, batcher.config, info.cfg.kv_bytes_per_token(info.dtype),
                                   seed=config.seed + len(engines))
        engines.append(engine)
    fingerprint = None
    if networked:  # hashed once, off the event loop (see node.transport.fingerprint)
        fingerprint = await loop.run_in_executor(None, engines[0].runner.fingerprint, config, info)
        log.info("model_fingerprint", digest=fingerprint.digest, weights=fingerprint.weights[:16],
                 tokenizer=fingerprint.tokenizer[:16], config=fingerprint.config[:16])
    log.info("engines_ready", layout=config.engine_layout,
             engines={e.device_id: e.runner.pid for e in engines})
    return info, engines, fingerprint
