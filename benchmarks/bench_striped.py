"""Striped against unstriped loads at TP=8: bytes read from the store and load time.

(And striped loads agreed round by round first, ``kvconn.rounds``, as the SGLang adapter
makes them: ``rounds``.)

Eight rank processes form a gloo group (as an engine's TP ranks would hand kvconn
theirs). Each rank holds two connectors over the same store: one with the group
(striped: a page several ranks hold is read once per group and passed over gloo), one
without (every rank reads every page it loads). The ranks save ``--blocks`` blocks, then
every trial loads them once with each connector, in a shuffled order (the same on every
rank), each load started after a barrier. Reported per model and store:

* bytes read from the store per loaded block, summed over the group, with and without
  striping, and the block's unique bytes (every distinct page once: the target);
* the group's load time (the slowest rank's, median over trials) and the median of the
  per-trial ratios striped / unstriped, with their 25th-75th percentiles;
* the same load through :class:`kvconn.rounds.LoadRounds` (over a gloo group of its
  own, its connector checking no replicas), the median ratio rounds / striped, and what
  idle rounds cost: the CPU each rank's process spends per second while the rounds run
  with no load, less what it spends in as long without them (``idle CPU``, a share of
  one core; two windows of 2 s after the trials).

Every load must load every block, and the last one of each kind is verified byte for
byte. Stores: a redis-server and a Mooncake master with one storage process, started
on free loopback ports (and LMDB in a directory with ``--backend lmdb``).

    python benchmarks/bench_striped.py
    python benchmarks/bench_striped.py --backend redis --model deepseek-v3.2 --trials 9

On a 2-core machine the eight ranks share two cores: the exchange's copies and the
store's copies compete for the same CPUs, so the times say what striping costs or saves
in CPU here, not what a GPU node with one core per rank and a network store would see.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.hashing import block_hashes
from kvconn.lookup import PageKeys
from kvconn.rounds import LoadRounds
from kvconn.testing.ranks import run_ranks
from kvconn.testing.tpgroup import compute_block, gloo_group, verify_block
from kvconn.tools.devserver.mooncake import MooncakeCluster, keep_transfers_on_loopback
from kvconn.tools.devserver.redis import RedisServer
from kvconn.tools.models import get_preset

MiB = 2**20
MODELS = ("minimax-m3", "qwen3-235b-a22b", "deepseek-v3.2")
BACKENDS = ("lmdb", "redis", "mooncake")
KINDS = ("unstriped", "striped", "rounds")
#: Seconds the rounds run with no load, to measure what an idle group costs.
IDLE_S = 2.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--backend", nargs="+", choices=BACKENDS, default=["redis", "mooncake"])
    parser.add_argument("--tp", type=int, default=8, help="ranks (8)")
    parser.add_argument("--layers", type=int, default=4, help="layers per block (4)")
    parser.add_argument("--blocks", type=int, default=32, help="blocks per load (32)")
    parser.add_argument("--trials", type=int, default=7, help="loads of each kind (7)")
    return parser.parse_args(argv)


def _rank(
    rank: int,
    model: str,
    opts: dict[str, Any],
    config: dict[str, Any],
    rendezvous: str,
    results: Any,
) -> None:
    """One rank: save the blocks, then time loads of each kind, as told by ``opts``."""
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        tp, blocks = opts["tp"], opts["blocks"]
        group = gloo_group(rank, tp, rendezvous)
        coord = dist.new_group(list(range(tp)))  # the benchmark's barriers, never kvconn's
        layout = get_preset(model).layout(tp, opts["layers"], 2 * blocks, 32)
        pools = [torch.zeros(n, dtype=torch.uint8) for n in layout.pool_sizes]
        hashes = block_hashes(list(range(32 * blocks)), 32)
        for slot, h in enumerate(hashes):
            compute_block(layout, rank, pools, h, slot)
        conns = {
            "striped": Connector(
                {**config, "stripe_reads": True}, layout, rank=rank, pools=pools, group=group
            ),
            "unstriped": Connector(config, layout, rank=rank, pools=pools),
            # the rounds' thread runs collectives on its own: a group of its own
            "rounds": Connector(
                {**config, "stripe_reads": True, "verify_replicas_every": 0},
                layout,
                rank=rank,
                pools=pools,
                group=dist.new_group(list(range(tp))),
            ),
        }
        assert conns["unstriped"].save(hashes, list(range(blocks))).ok
        dist.barrier(group=coord)
        slots = list(range(blocks, 2 * blocks))
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        read: dict[str, int] = dict.fromkeys(KINDS, 0)
        bad = 0
        handed_back = 0  # loads the rounds gave up striping (a rank too late): read alone
        for trial in range(opts["trials"] + 1):  # the first is a warm-up
            order = list(KINDS)
            random.Random(trial).shuffle(order)  # the same order on every rank
            for kind in order:
                conn = conns[kind]
                for pool in pools:  # the load must write what it reports
                    pool[pool.numel() // 2 :].zero_()
                dist.barrier(group=coord)
                before = conn.stats.bytes("store_read")
                # rounds run only around their own load: idle rounds take CPU
                rounds = LoadRounds(conn) if kind == "rounds" else None
                start = time.perf_counter()
                result = conn.load(hashes, slots) if rounds is None else rounds.load(hashes, slots)
                elapsed = time.perf_counter() - start
                if rounds is not None:
                    rounds.close()
                    handed_back += rounds.handed_back
                assert result.loaded == blocks, (kind, result)
                if trial:
                    times[kind].append(elapsed)
                    read[kind] += conn.stats.bytes("store_read") - before
                if trial == opts["trials"]:
                    bad += sum(
                        verify_block(layout, rank, pools, h, s) for h, s in zip(hashes, slots)
                    )
        dist.barrier(group=coord)
        cpu = time.process_time()
        time.sleep(IDLE_S)  # what the process spends anyway (a store client's threads)
        base_cpu = time.process_time() - cpu
        rounds = LoadRounds(conns["rounds"])
        cpu = time.process_time()
        time.sleep(IDLE_S)
        idle_cpu = (time.process_time() - cpu - base_cpu) / IDLE_S
        rounds.close()
        payload = {"times": times, "read": read, "bad": bad, "idle_cpu": idle_cpu}
        payload["handed_back"] = handed_back
        for conn in conns.values():
            conn.close()
        dist.destroy_process_group()
        results.put((rank, payload))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def unique_bytes(model: str, tp: int, layers: int) -> int:
    """A block's distinct pages, each once: what a group must read at least."""
    keys = PageKeys({"model": "bench", "backend": "lmdb"}, get_preset(model).layout(tp, layers))
    return sum(p.page_size * p.shard_class.shard_count for p in keys.plans)


def measure(model: str, config: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvconn-bench-striped-") as tmp:
        out = run_ranks(
            _rank,
            opts["tp"],
            (model, opts, config, os.path.join(tmp, "rendezvous")),
            timeout_s=1800,
        )
    for payload in out:
        if "error" in payload:
            raise SystemExit(payload["error"])
    loads = opts["blocks"] * opts["trials"]
    row: dict[str, Any] = {"bad": sum(p["bad"] for p in out)}
    row["idle_cpu"] = statistics.median(p["idle_cpu"] for p in out)
    row["handed_back"] = sum(p["handed_back"] for p in out)
    for kind in KINDS:
        # a load takes as long as its slowest rank (every rank started at a barrier)
        per_trial = [max(p["times"][kind][i] for p in out) for i in range(opts["trials"])]
        row[kind] = {
            "read_per_block": sum(p["read"][kind] for p in out) / loads,
            "seconds": statistics.median(per_trial),
            "per_trial": per_trial,
        }
    ratios = [s / u for s, u in zip(row["striped"]["per_trial"], row["unstriped"]["per_trial"])]
    row["time_ratio"] = statistics.median(ratios)
    row["rounds_ratio"] = statistics.median(
        r / s for r, s in zip(row["rounds"]["per_trial"], row["striped"]["per_trial"])
    )
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    row["time_ratio_iqr"] = (quartiles[0], quartiles[2])
    return row


@contextlib.contextmanager
def store(name: str, opts: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A fresh store of ``name`` and the options its connectors use."""
    if name == "lmdb":
        with tempfile.TemporaryDirectory(prefix="kvconn-bench-") as path:
            yield {"path": path}
    elif name == "redis":
        with RedisServer() as server:
            yield dict(server.options)
    else:
        keep_transfers_on_loopback()
        with MooncakeCluster(storage_processes=1, segment_size=512 * MiB) as cluster:
            yield {**cluster.options, "read_env": False}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    opts = {"tp": args.tp, "layers": args.layers, "blocks": args.blocks, "trials": args.trials}
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, python {sys.version.split()[0]}; "
        f"TP={args.tp} ranks as processes over gloo, {args.layers} layers, "
        f"{args.blocks} blocks of 32 tokens per load, {args.trials} loads of each kind "
        "(shuffled), medians of the slowest rank"
    )
    print(
        f"{'model':>16} {'store':>9} {'unique/blk':>11} {'read/blk':>10} {'striped':>10} "
        f"{'ratio':>6} {'load ms':>9} {'striped':>9} {'ratio [p25-p75]':>17} "
        f"{'rounds':>8} {'/striped':>8} {'idle CPU':>8}"
    )
    for backend in args.backend:
        with store(backend, opts) as options:
            for model in args.model:
                config = {"model": f"bench-{model}", "backend": backend, "options": options}
                ConnectorConfig.from_dict(config)  # a bad option fails here, not in 8 ranks
                row = measure(model, config, opts)
                unique = unique_bytes(model, args.tp, args.layers)
                plain, striped = row["unstriped"], row["striped"]
                print(
                    f"{model:>16} {backend:>9} {unique / 1024:>8.0f} KiB "
                    f"{plain['read_per_block'] / 1024:>6.0f} KiB "
                    f"{striped['read_per_block'] / 1024:>6.0f} KiB "
                    f"{striped['read_per_block'] / plain['read_per_block']:>6.3f} "
                    f"{plain['seconds'] * 1000:>9.1f} {striped['seconds'] * 1000:>9.1f} "
                    f"{row['time_ratio']:>6.2f} [{row['time_ratio_iqr'][0]:.2f}-"
                    f"{row['time_ratio_iqr'][1]:.2f}] "
                    f"{row['rounds']['seconds'] * 1000:>8.1f} {row['rounds_ratio']:>8.2f} "
                    f"{row['idle_cpu']:>8.1%}"
                    + ("" if row["bad"] == 0 else f"   {row['bad']} REGIONS DIFFER")
                    + (f"   {row['handed_back']} read alone" if row["handed_back"] else ""),
                    flush=True,
                )


if __name__ == "__main__":  # rank processes re-import this module: keep the guard
    main()
