"""Why the node refuses a request now (the API answers each with 503 and ``Retry-After``, or 400 when it
can never be served)."""

from node.core.role_state import blocks_for


class QueueFullError(RuntimeError):
    """More requests are queued than ``--max-queue`` allows (the API answers 503)."""


class NodeDraining(QueueFullError):
    """The node is draining to its peers and takes no new requests (the API answers 503)."""


class EnginesDown(QueueFullError):
    """Every device's engine is down: nothing can serve (the API answers 503 ``engine_down``)."""


class KVCapacityExceeded(QueueFullError):
    """The request can never be served: its prompt, once per choice, does not fit the KV cache of any
    device that could prefill it, even empty (the API answers 400 ``kv_capacity_exceeded``, streamed or
    not, before anything is sent). A refusal like the others, so every layout refuses it at one place."""


def kv_fit_error(prompt_tokens: int, n: int, mode: str, block_size: int, device_blocks: list[int]) -> str | None:
    """Why a request of ``n`` choices of a ``prompt_tokens``-token prompt can never be placed, or None.

    The role policies (time-shared, adaptive) reserve the prompt once per choice plus one token on one
    device (:meth:`RoleScheduler._reject <node.core.roles.RoleScheduler>`); pooled prefill devices hold the
    prompt once per choice plus each choice's first token (:class:`~node.core.pooled.PooledRouter`);
    colocated mode admits the choices one by one, so a prompt that fits ``--max-model-len`` always fits
    (checked at start-up). ``device_blocks``: the KV blocks of each device that could prefill it.
    """
    if mode == "colocated" or not device_blocks:
        return None
    tokens = prompt_tokens * n + (n if mode == "pooled" else 1)
    need = blocks_for(tokens, block_size)  # the policies' own rounding
    if need <= max(device_blocks):
        return None
    return (f"request cannot be served: its prompt ({prompt_tokens} tokens) times n ({n}) plus "
            f"{'one token per choice' if mode == 'pooled' else 'one token'} needs {need} KV blocks of "
            f"{block_size} tokens, and the largest device holds {max(device_blocks)} even when empty")
