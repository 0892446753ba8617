"""The fail-over benchmark runs against a real cluster and measures what it says."""

from __future__ import annotations

import re

import pytest

from benchmarks import bench_mooncake_death
from kvconn.testing.suite import require_or_skip
from kvconn.tools.devserver.mooncake import MooncakeCluster


def test_the_benchmark_stores_every_key_through_kvconn_while_a_storage_process_is_dead(
    capsys: pytest.CaptureFixture[str],
) -> None:
    require_or_skip(MooncakeCluster.available())
    # 16 keys a batch: a batch is lost only if all 16 land on the dead process twice
    # (first try and the placement anywhere), 1 in 2**32; with 4 keys it was 1 in 256
    # per batch, and CI met it
    assert bench_mooncake_death.main(["--rounds", "1", "--batches", "2", "--keys", "16"]) == 0
    stored = dict(
        re.findall(
            r"^(no reroute|reroute|fixed order|kvconn)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\S+)"
            r"\s+\d+%$",
            capsys.readouterr().out,
            re.M,
        )
    )
    assert set(stored) == {"no reroute", "reroute", "fixed order", "kvconn"}
    assert stored["kvconn"] == stored["reroute"] == "32/32"  # every key, rerouted or steered
