"""The vLLM benchmark's account of how the ranks reported a hit's load at TP >= 2.

vLLM admits a hit in the step after every rank has reported its load; a rank that
reports a step late, or the first rank's sleep in that step, holds the hit. These
figures say how often that happened in a run, so a change to the idle wait shows in
any run, not only in the runs where the ranks happened to report apart.
"""

from __future__ import annotations

from typing import Any

from benchmarks.bench_engine_vllm import (
    EngineRun,
    Results,
    inside_figures,
    parse_args,
    rank_report_cells,
    rank_reports,
    report,
)

STEP = 0.010  # seconds between a rank's get_transfer_results calls


def calls(
    pid: int, report_step: int, steps: int = 5, wait_s: float = 0.005
) -> list[dict[str, Any]]:
    """One rank's get_transfer_results calls, one a step from t=1; it reports its load in
    ``report_step``; every call lasts ``wait_s`` (an idle step's sleep)."""
    return [
        {
            "m": "get_transfer_results",
            "t0": 1.0 + i * STEP,
            "dt": wait_s,
            "pid": pid,
            "role": "worker",
            "recving": int(i == report_step),
        }
        for i in range(steps)
    ]


def test_ranks_that_report_in_one_step_are_not_apart() -> None:
    run = EngineRun("job", None, calls(1, 2) + calls(2, 2))
    figures = rank_reports(run, 0.0, 2.0)
    assert figures["ranks_apart"] == 0
    assert figures["report_spread"] == 0
    assert "wait_after_report" not in figures


def test_a_rank_a_step_behind_is_apart_and_the_first_ranks_next_call_is_its_wait() -> None:
    first = calls(1, 1)
    first[2]["dt"] = 0.0051  # the first rank's next step: where it slept idle_wait_s
    run = EngineRun("job", None, first + calls(2, 2, wait_s=0.0001))
    figures = rank_reports(run, 0.0, 2.0)
    assert figures["ranks_apart"] == 1
    assert abs(figures["report_spread"] - (STEP + 0.0001 - 0.005)) < 1e-9
    assert figures["wait_after_report"] == 0.0051


def test_one_rank_or_calls_outside_the_phase_give_no_figures() -> None:
    assert rank_reports(EngineRun("job", None, calls(1, 1)), 0.0, 2.0) == {}
    late = calls(2, 1)
    assert rank_reports(EngineRun("job", None, calls(1, 1) + late), 0.0, 1.005) == {}


def later(records: list[dict[str, Any]], by: float) -> list[dict[str, Any]]:
    return [dict(r, t0=r["t0"] + by) for r in records]


def test_the_tp2_table_counts_the_hits_reported_apart() -> None:
    phases = [
        {
            "name": name,
            "start": start,
            "end": start + 0.9,
            "requests": {"p": {"submitted": start, "tokens": [start + 0.8], "cached": 2016}},
        }
        for name, start in (("fresh", 0.5), ("repeat", 1.5))
    ]
    # the model's first layer asks for its KV after the reports, in both hits
    layers = [{"m": "wait_for_layer_load", "t0": t, "dt": 0.0, "pid": 1} for t in (1.1, 2.1)]
    together = calls(1, 2) + calls(2, 2)
    results = Results()
    for repeat in (together, calls(1, 2) + calls(2, 3)):  # trial 2's repeat: a step apart
        fresh = EngineRun("job", {"phases": phases}, together + later(repeat, 1.0) + layers)
        results.add("inside", 2, "kvconn-lmdb", inside_figures(EngineRun("s", None), fresh))
    assert rank_report_cells(results, 2, "kvconn-lmdb") == ["1 of 4", "10.0", "5.00"]
    args = parse_args(["--configs", "kvconn-lmdb", "--tp", "2", "--figures", "inside"])
    text = report(args, results)
    assert "until the model runs, TP=2" in text
    assert "ranks apart" in text
    results.samples["inside/tp1/kvconn-lmdb"] = results.samples.pop("inside/tp2/kvconn-lmdb")
    args = parse_args(["--configs", "kvconn-lmdb", "--tp", "1", "--figures", "inside"])
    text = report(args, results)
    assert "until the model runs, TP=1" in text
    assert "ranks apart" not in text
