"""Live load against real ``shiftnode serve`` processes: replay, host overhead, soak, fuzzing, membership.

* :mod:`bench.load.replay` — the trace replay client (streaming completions, per-request records);
* :mod:`bench.load.node_process` and :mod:`bench.load.etcd_server` — a node / a throwaway etcd as a
  subprocess on free loopback ports, always stopped (also used by tests);
* :mod:`bench.load.stream_client` — closed-loop streaming load split over client processes (host_overhead's);
* :mod:`bench.load.host_overhead`, :mod:`bench.load.soak`, :mod:`bench.load.fuzz`,
  :mod:`bench.load.membership` — the tools built on them.

Imports :mod:`bench.traffic` only.
"""
