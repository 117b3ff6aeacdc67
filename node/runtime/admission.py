"""Why the node refuses a request now (the API answers each with 503 and ``Retry-After``)."""


class QueueFullError(RuntimeError):
    """More requests are queued than ``--max-queue`` allows (the API answers 503)."""


class NodeDraining(QueueFullError):
    """The node is draining to its peers and takes no new requests (the API answers 503)."""


class EnginesDown(QueueFullError):
    """Every device's engine is down: nothing can serve (the API answers 503 ``engine_down``)."""
