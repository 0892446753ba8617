"""Which CPUs kvconn's transfer threads use inside vLLM's CPU backend.

vLLM's CPU workers bind their OpenMP threads, the step's own thread among them, to
cores (``VLLM_CPU_OMP_THREADS_BIND``), and a thread started later inherits the core of
the thread that started it. kvconn's store and load threads would then share the core
the forward pass runs on. vLLM keeps cores out of the binding for other work: with a
KV connector configured, one more per rank (``VLLM_CPU_NUM_OF_RESERVED_CPU`` overrides
the count), taken from the end of each rank's cores; and its NIXL connector moves its
transfer work to the last physical core of each NUMA node (the highest of each list
``discover_numa_topology`` gives). kvconn's transfer threads run on that core of their
rank's own NUMA node, unless a rank's OpenMP threads are bound to it (no core was
kept), in which case nothing changes. That is kvconn's ``transfer_cpus = "auto"``;
the setting can also keep them on the step's cores or name others (:mod:`kvconn.cpus`).

Pure functions over what vLLM says, so the choice is testable without an engine.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from kvconn.cpus import parse_cpu_list as cpu_list

__all__ = ["numa_nodes", "parse_cpu_list", "transfer_cpus", "vllm_transfer_cpus"]

BIND_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"
NODES = Path("/sys/devices/system/node")


def parse_cpu_list(text: str) -> set[int]:
    """CPUs of one rank's list in ``VLLM_CPU_OMP_THREADS_BIND`` syntax (``"0-3,8"``)."""
    return cpu_list(text, BIND_VARIABLE)


def numa_nodes(root: Path = NODES) -> list[set[int]]:
    """Each NUMA node's CPUs, from sysfs; empty where sysfs does not say."""
    nodes = []
    for path in sorted(root.glob("node[0-9]*/cpulist")):
        try:
            nodes.append(parse_cpu_list(path.read_text().strip()))
        except (OSError, ValueError):
            continue
    return nodes


def transfer_cpus(
    kv_cores: Iterable[Iterable[int]],
    bind: str,
    own: Iterable[int],
    nodes: Iterable[set[int]] = (),
) -> frozenset[int] | None:
    """The CPUs for kvconn's transfer threads, or None to leave them where they start.

    ``kv_cores``: each NUMA node's physical cores as vLLM's platform lists them
    (``discover_numa_topology``); the last of each is the one kept for KV transfers.
    ``bind``: the value of ``VLLM_CPU_OMP_THREADS_BIND`` (``"auto"`` by default;
    ``"nobind"``: vLLM binds nothing, so neither does kvconn; else a ``|``-separated list
    per rank, whose cores are all taken by compute threads). ``own``: the cores of the
    thread that builds the connector, this rank's compute cores. ``nodes``: each NUMA
    node's CPUs; where given, only the cores on a node of ``own`` are chosen, so a rank
    never takes another node's core (with ``auto`` binding and no core kept, another
    rank's compute core).
    """
    bind = bind.strip()
    if bind == "nobind":
        return None
    own = set(own)
    chosen = {max(node) for node in map(list, kv_cores) if node} - own
    if bind not in ("", "auto"):
        for ranks in bind.split("|"):
            chosen -= parse_cpu_list(ranks)
    local = [node for node in nodes if node & own]
    if local:
        chosen &= set().union(*local)
    return frozenset(chosen) or None


def vllm_transfer_cpus(
    platform: object, environ: Mapping[str, str] | None = None
) -> frozenset[int] | None:
    """:func:`transfer_cpus` for this worker, on vLLM's CPU platform; None elsewhere.

    Called on the thread that builds the connector, after vLLM bound it: its affinity is
    this rank's compute cores.
    """
    environ = os.environ if environ is None else environ
    is_cpu = getattr(platform, "is_cpu", None)
    discover = getattr(platform, "discover_numa_topology", None)
    if not callable(is_cpu) or not is_cpu() or not callable(discover):
        return None
    own = os.sched_getaffinity(0)
    return transfer_cpus(discover(), environ.get(BIND_VARIABLE, "auto"), own, numa_nodes())
