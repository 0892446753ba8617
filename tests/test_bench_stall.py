"""The vLLM benchmark's stall figure: which variants run, and what its table says.

The figure is the decoding request's inter-token latency while other requests load
hits; a variant run without its store, or a table naming a delay no variant had, would
report a stall that was not measured.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.bench_engine_vllm import (
    EngineRun,
    Results,
    parse_args,
    stall_figures,
    stall_report,
)


def stall_run(hit_firsts: list[float]) -> EngineRun:
    """``d`` decodes a token every 0.1 s from t=0; each hit's first token at the given time."""
    decode = [round(0.1 * i, 1) for i in range(40)]
    requests: dict[str, dict[str, Any]] = {
        "d": {"submitted": -0.1, "tokens": decode, "cached": 0, "finished": decode[-1]},
    }
    for i, first in enumerate(hit_firsts):
        requests[f"h{i}"] = {
            "submitted": 0.75,
            "tokens": [first, first + 0.1],
            "cached": 2016,
            "finished": 3.5,
        }
    return EngineRun("job", {"phases": [{"name": "stall", "requests": requests, "end": 4.0}]}, [])


def test_stall_variants_over_mooncake_run_only_with_their_store() -> None:
    args = parse_args(["--configs", "none", "kvconn-lmdb", "kvconn-mooncake-keptcore"])
    assert args.stall_variants == [
        "none-alone",
        "prefix-same",
        "kvconn-lmdb",
        "kvconn-slow",
        "kvconn-mooncake-keptcore",
    ]
    picked = ["--configs", "kvconn-mooncake", "--stall-variants", "none-alone", "kvconn-mooncake"]
    assert parse_args(picked).stall_variants == ["none-alone", "kvconn-mooncake"]
    with pytest.raises(SystemExit):
        parse_args(["--configs", "none", "--stall-variants", "kvconn-mooncake"])


def test_hits_prefilled_in_one_step_count_as_one_hit_step() -> None:
    together = stall_figures(stall_run([1.2, 1.2]))
    apart = stall_figures(stall_run([1.2, 1.5]))
    assert together["hit_steps"] == 1
    assert apart["hit_steps"] == 2
    # the window is the same: the hits' arrival to their end
    assert together["tokens_in_window"] == apart["tokens_in_window"] == 28
    assert together["others_cached"] == 2016


def test_the_stall_table_names_the_delay_only_when_the_delayed_store_ran() -> None:
    args = parse_args(["--configs", "none", "kvconn-lmdb", "--delay-ms", "150"])
    results = Results()
    for variant in ("none-alone", "prefix-same", "kvconn-lmdb"):
        results.add("stall", 1, variant, stall_figures(stall_run([1.2, 1.5])))
    undelayed = stall_report(args, results, 1)
    assert undelayed is not None
    assert "150 ms" not in undelayed
    assert "kvconn, LMDB + delay" not in undelayed
    results.add("stall", 1, "kvconn-slow", stall_figures(stall_run([1.2, 1.2])))
    delayed = stall_report(args, results, 1)
    assert delayed is not None
    assert "kvconn, LMDB + delay: 150 ms per call" in delayed
    assert stall_report(args, results, 2) is None
