"""kvconn.testing.ranks: payloads by rank, and no silent hang when a rank misbehaves."""

from __future__ import annotations

import os
import time

import pytest

from kvconn.testing.ranks import run_ranks


def _echo(rank, scale, results):
    results.put((rank, rank * scale))


def _rank_1_dies(rank, results):
    if rank == 1:
        os._exit(3)
    results.put((rank, "ok"))


def _rank_1_hangs(rank, results):
    if rank == 1:
        time.sleep(60)
    results.put((rank, "ok"))


def test_payloads_come_back_ordered_by_rank():
    assert run_ranks(_echo, 3, (10,), timeout_s=60) == [0, 10, 20]


def test_a_rank_that_dies_without_reporting_is_an_error():
    with pytest.raises(RuntimeError, match="exit code 3"):
        run_ranks(_rank_1_dies, 2, timeout_s=60)


def test_a_rank_that_does_not_finish_in_time_is_an_error():
    with pytest.raises(TimeoutError, match="1 of 2 ranks"):
        run_ranks(_rank_1_hangs, 2, timeout_s=3)


def _report_environment(rank, results):
    print(f"rank {rank} writes to the parent's stdout")
    results.put((rank, os.environ.get("KVCONN_TEST_RANK_VARIABLE")))


def test_ranks_see_the_parents_environment_and_streams_as_they_are_at_the_start(monkeypatch, capfd):
    """A fork server's child would otherwise inherit the server's, fixed when it started."""
    run_ranks(_echo, 1, (1,), timeout_s=60)  # the fork server runs before the change
    monkeypatch.setenv("KVCONN_TEST_RANK_VARIABLE", "set later")
    assert run_ranks(_report_environment, 2, timeout_s=60) == ["set later"] * 2
    out = capfd.readouterr().out
    assert "rank 0 writes to the parent's stdout" in out
    assert "rank 1 writes to the parent's stdout" in out
    monkeypatch.delenv("KVCONN_TEST_RANK_VARIABLE")
    assert run_ranks(_report_environment, 1, timeout_s=60) == [None]
