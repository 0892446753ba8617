"""The vLLM benchmark's account of where the CPU went while a request decoded.

The figure separates a connector's part of a token from the forward pass's speed, which
varies between engine processes; a thread put in the wrong group would move the
forward pass's time into the connector's or hide the connector's in the model's.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.bench_engine_vllm import (
    CONFIGS,
    EngineRun,
    Plan,
    Results,
    decode_cpu,
    decode_cpu_values,
    hit_cpu_report,
    inside_figures,
    parse_args,
    tpot_model_aside,
)

MS = 1_000_000  # nanoseconds

FRONT, TRACKER, CORE, WORKER, STORE = 100, 101, 102, 103, 200
PARENTS = {FRONT: 1, TRACKER: FRONT, CORE: FRONT, WORKER: CORE, STORE: 1}


def snapshot(t: float, ran_ms: dict[str, float], waited_ms: float = 0.0) -> dict[str, Any]:
    """A cpu_snapshot as the engine job writes it (JSON: process ids as strings)."""
    threads = {key: [int(ms * MS), 0] for key, ms in ran_ms.items()}
    threads[f"{WORKER}/{WORKER}"][1] = int(waited_ms * MS)
    return {
        "t": t,
        "engine": [FRONT, TRACKER, CORE, WORKER],
        "threads": threads,
        "parents": {str(pid): ppid for pid, ppid in PARENTS.items()},
    }


def engine_run(ran_ms: dict[str, float], *, calls_s: float = 0.0, wall_s: float = 1.0) -> EngineRun:
    """Ten tokens decoded in ``wall_s``; each thread ran ``ran_ms`` meanwhile."""
    start = {key: 5.0 for key in ran_ms}  # CPU before decoding began is not counted
    end = {key: 5.0 + ms for key, ms in ran_ms.items()}
    phase = {
        "name": "store",
        "requests": {"p": {"tokens": [10.0 + i * wall_s / 10 for i in range(11)]}},
        "cpu": {
            "decode": snapshot(10.0, start, waited_ms=1.0),
            "end": snapshot(10.0 + wall_s, end, waited_ms=3.0),
        },
    }
    records = [
        {"m": "thread", "t0": 9.5, "dt": 0.0, "pid": WORKER, "tid": 120, "name": "kvconn-store"},
        {"m": "save_kv_layer", "t0": 10.5, "dt": calls_s, "pid": WORKER},
        {"m": "save_kv_layer", "t0": 9.5, "dt": 5.0, "pid": WORKER},  # before decoding
    ]
    return EngineRun("job", {"phases": [phase]}, records)


THREADS = {
    f"{FRONT}/{FRONT}": 6.0,
    f"{TRACKER}/{TRACKER}": 1.0,
    f"{CORE}/{CORE}": 990.0,
    f"{CORE}/111": 2.0,
    f"{WORKER}/{WORKER}": 960.0,
    f"{WORKER}/120": 8.0,
    f"{WORKER}/121": 4.0,
    f"{STORE}/{STORE}": 12.0,
}


def test_each_thread_counts_in_its_own_group_per_decoded_token() -> None:
    ms = decode_cpu(engine_run(THREADS, calls_s=0.02))
    assert ms["model"] == pytest.approx(96.0)  # the worker's main thread
    assert ms["model_wait"] == pytest.approx(0.2)  # 2 ms waited over 10 tokens
    assert ms["scheduler"] == pytest.approx(99.0)  # the process that started the worker
    assert ms["kvconn"] == pytest.approx(0.8)  # the thread the plugin named
    assert ms["engine_other"] == pytest.approx(0.7)  # the tracker and other threads
    assert ms["front_end"] == pytest.approx(0.6)
    assert ms["stores"] == pytest.approx(1.2)
    assert ms["wall"] == pytest.approx(100.0)
    assert ms["calls"] == pytest.approx(2.0)  # only the call made while decoding
    assert ms["off_model"] == pytest.approx(100.0 - 96.0 + 2.0)


def test_without_worker_processes_the_engine_core_runs_the_model() -> None:
    threads = {k: v for k, v in THREADS.items() if not k.startswith(f"{WORKER}/")}
    run = engine_run({**threads, f"{WORKER}/{WORKER}": 0.0})
    run.result["phases"][0]["cpu"]["end"]["parents"].pop(str(WORKER))  # type: ignore[index]
    ms = decode_cpu(run)
    assert ms["model"] == pytest.approx(99.0)
    assert ms["scheduler"] == 0.0


def test_a_slower_forward_pass_is_not_the_connectors_but_its_threads_are() -> None:
    results = Results()
    results.add(
        "ttft",
        1,
        "none",
        decode_cpu_values(engine_run(THREADS)),
    )
    slower_model = {**THREADS, f"{WORKER}/{WORKER}": 1060.0, f"{CORE}/{CORE}": 1090.0}
    results.add(
        "ttft",
        1,
        "slow",
        decode_cpu_values(engine_run(slower_model, wall_s=1.1)),
    )
    busier = {**THREADS, f"{WORKER}/120": 58.0}  # 50 ms more on kvconn's thread
    results.add(
        "ttft",
        1,
        "busy",
        decode_cpu_values(engine_run(busier, calls_s=0.03)),
    )
    assert tpot_model_aside(results, "slow") == pytest.approx(1.0)
    # 3 ms of calls and 5 ms of kvconn's CPU per token, on a 100 ms token
    assert tpot_model_aside(results, "busy") == pytest.approx(1.08)
    assert tpot_model_aside(results, "absent") is None


def test_only_the_phases_the_tpot_and_inside_figures_read_ask_for_cpu_snapshots() -> None:
    args = parse_args(["--figures", "tpot", "ttft", "concurrency", "--tp", "1"])
    engines = dict(Plan(args, 0, 1).ttft_engines(CONFIGS["kvconn-lmdb"], set(args.figures)))
    asking = [(role, p["name"]) for role, phases in engines.items() for p in phases if p.get("cpu")]
    assert asking == [("first", "store")]
    inside = Plan(args, 0, 1).ttft_engines(CONFIGS["kvconn-lmdb"], {"ttft", "inside"})
    kinds = [(role, p["name"], p["cpu"]) for role, phases in inside for p in phases if p.get("cpu")]
    assert kinds == [("fresh", "fresh", "phase"), ("fresh", "repeat", "phase")]
    without = Plan(args, 0, 1).ttft_engines(CONFIGS["kvconn-lmdb"], {"ttft"})
    assert not any(p.get("cpu") for _, phases in without for p in phases)


def hit_run(model_ms: float, waited_ms: float) -> EngineRun:
    """A fresh engine's hit submitted at t=10, its first layer at 10.05 and its first
    token at 10.5; the worker's main thread ran ``model_ms`` and waited ``waited_ms``."""
    threads = {**THREADS, f"{WORKER}/{WORKER}": model_ms}
    phase = {
        "name": "fresh",
        "start": 10.0,
        "end": 10.5,
        "requests": {"p": {"submitted": 10.0, "tokens": [10.5], "cached": 2016}},
        "cpu": {
            "start": snapshot(9.99, dict.fromkeys(threads, 0.0)),
            "end": snapshot(10.51, threads, waited_ms=waited_ms),
        },
    }
    records = [
        {"m": "thread", "t0": 9.0, "dt": 0.0, "pid": WORKER, "tid": 120, "name": "kvconn-load"},
        {"m": "wait_for_layer_load", "t0": 10.05, "dt": 0.0, "pid": WORKER},
        {"m": "gc", "t0": 10.2, "dt": 0.03, "pid": WORKER, "gen": 2},  # in the pass
        {"m": "gc", "t0": 10.01, "dt": 0.5, "pid": WORKER, "gen": 2},  # before it
    ]
    return EngineRun("job", {"phases": [phase]}, records)


def test_a_hit_says_whether_its_forward_pass_ran_longer_or_waited_for_a_cpu() -> None:
    results = Results()
    for config, model_ms, waited_ms in (("example", 400.0, 5.0), ("kvconn-lmdb", 400.0, 90.0)):
        figures = inside_figures(EngineRun("s", None), hit_run(model_ms, waited_ms))
        assert figures["forward_fresh"] == pytest.approx(0.45)
        assert figures["gc_forward_fresh"] == pytest.approx(0.03)
        assert figures["hit_cpu_wall_fresh"] == pytest.approx(520.0)
        assert figures["hit_cpu_model_fresh"] == pytest.approx(model_ms)
        assert figures["hit_cpu_model_wait_fresh"] == pytest.approx(waited_ms)
        assert figures["hit_cpu_kvconn_fresh"] == pytest.approx(8.0)
        results.add("inside", 2, config, figures)
    text = hit_cpu_report(results, 2, ["example", "kvconn-lmdb"])
    assert text is not None
    assert "TP=2" in text
    kvconn_row = text.splitlines()[-1].split()
    assert kvconn_row[-10:] == ["450", "30.0", "520", "400", "90", "990", "8", "7", "6", "12"]
    assert hit_cpu_report(results, 1, ["example", "kvconn-lmdb"]) is None
