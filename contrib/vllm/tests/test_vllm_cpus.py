"""kvconn's transfer threads go to the cores vLLM's CPU backend keeps for KV transfers.

Pure choices over what vLLM says (``kvconn_vllm.cpus``); the end-to-end tests run the
engine with whatever binding this machine gives.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvconn_vllm.cpus import numa_nodes, parse_cpu_list, transfer_cpus, vllm_transfer_cpus


def test_at_tp1_the_kept_core_takes_the_transfers_and_the_step_keeps_its_own() -> None:
    # 2 CPUs, automatic binding, one core kept: the step on 0, vLLM's KV core is 1
    assert transfer_cpus([[0, 1]], "auto", own={0}, nodes=[{0, 1}]) == {1}


def test_when_every_core_computes_the_transfers_stay_where_they_start() -> None:
    # TP=2 on 2 CPUs, bound by hand ("0|1"): vLLM's KV core is rank 1's compute core
    assert transfer_cpus([[1]], "0|1", own={0}, nodes=[{0, 1}]) is None
    assert transfer_cpus([[1]], "0|1", own={1}, nodes=[{0, 1}]) is None
    # automatic binding that kept no core: the last core is this rank's own
    assert transfer_cpus([[1]], "auto", own={0, 1}, nodes=[{0, 1}]) is None


def test_a_hand_made_binding_leaves_its_unbound_kv_core_to_the_transfers() -> None:
    cores = [list(range(8))]
    assert transfer_cpus(cores, "0-2|4-6", own={0, 1, 2}, nodes=[set(range(8))]) == {7}
    assert transfer_cpus(cores, "0-2|4-7", own={0, 1, 2}, nodes=[set(range(8))]) is None


def test_nobind_binds_nothing_so_kvconn_binds_nothing() -> None:
    assert transfer_cpus([[1]], "nobind", own={0}, nodes=[{0, 1}]) is None


def test_a_rank_takes_the_kv_core_of_its_own_numa_node_only() -> None:
    nodes = [set(range(4)), set(range(4, 8))]
    cores = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert transfer_cpus(cores, "auto", own={0, 1, 2}, nodes=nodes) == {3}
    assert transfer_cpus(cores, "auto", own={4, 5, 6}, nodes=nodes) == {7}
    # unknown topology: every kept core that no rank computes on
    assert transfer_cpus(cores, "auto", own={0, 1, 2}) == {3, 7}


def test_cpu_lists_read_as_vllm_writes_them() -> None:
    assert parse_cpu_list("0-3,8, 10") == {0, 1, 2, 3, 8, 10}
    assert parse_cpu_list("") == set()
    for bad in ("a", "3-1", "1-", "-2"):
        with pytest.raises(ValueError, match="VLLM_CPU_OMP_THREADS_BIND"):
            parse_cpu_list(bad)


def test_numa_nodes_are_read_from_sysfs_and_an_unreadable_node_is_skipped(tmp_path: Path) -> None:
    for name, text in (("node0", "0-3\n"), ("node1", "4-7\n"), ("node2", "garbage\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cpulist").write_text(text)
    assert numa_nodes(tmp_path) == [{0, 1, 2, 3}, {4, 5, 6, 7}]


def platform(is_cpu: bool, kv_cores: list[list[int]]) -> Any:
    return SimpleNamespace(is_cpu=lambda: is_cpu, discover_numa_topology=lambda: kv_cores)


def test_the_workers_choice_reads_its_own_binding_and_vllms_variable() -> None:
    allowed = os.sched_getaffinity(0)
    nodes = [sorted(node & allowed) for node in numa_nodes()] or [sorted(allowed)]
    node = max(nodes, key=len)
    if len(node) < 2:
        pytest.skip("needs two CPUs on one NUMA node")
    step, kept = node[0], node[-1]
    seen: dict[str, Any] = {}

    def bound_worker() -> None:  # as vLLM leaves the thread that builds the connector
        os.sched_setaffinity(0, {step})
        seen["auto"] = vllm_transfer_cpus(platform(True, [[step, kept]]), {})
        seen["gpu"] = vllm_transfer_cpus(platform(False, [[kept]]), {})
        seen["nobind"] = vllm_transfer_cpus(
            platform(True, [[kept]]), {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        )

    thread = threading.Thread(target=bound_worker)
    thread.start()
    thread.join()
    assert seen == {"auto": {kept}, "gpu": None, "nobind": None}
    assert vllm_transfer_cpus(SimpleNamespace(), {}) is None  # a platform without the call
