"""What a replica check costs: copy the shared pages out of the pool, digest them, compare
them over a gloo group, at the models' real layer counts.

The TP ranks are processes (``--tp``, default 8) that form a gloo group and share an LMDB
store in a directory. Each trial, after a barrier, every rank times (medians over
``--trials``; the group's figure is the slowest rank's):

* ``probe`` — copying this rank's pages of every shared kind for the checked blocks out
  of the pool (:meth:`ReplicaCheck.probes`, on the thread that saves);
* ``check`` — the rest (:meth:`Connector.check_replicas`): digests, rank 0's ``exists``
  of the markers, the ``all_gather``, the verdict;
* ``all_gather`` — the collective alone, with a check's message;
* ``save`` — a save of the same blocks with checks off, for scale.

A check covers 1 to 8 blocks (``BLOCKS_PER_CHECK``); at the default 1 block in 1000,
its cost per saved block is the 1-block check / 1000.

    python benchmarks/bench_replica_check.py
    python benchmarks/bench_replica_check.py --model deepseek-v3.2 --tp 4 --trials 21

On a 2-core machine the eight ranks share two cores: the collective waits for the
slowest rank to be scheduled, so ``check`` and ``all_gather`` are upper bounds here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.hashing import block_hashes
from kvconn.lookup import PageKeys
from kvconn.plan import WriterPolicy
from kvconn.replicas import BLOCKS_PER_CHECK, items_per_block
from kvconn.testing.ranks import run_ranks
from kvconn.testing.tpgroup import compute_block, gloo_group
from kvconn.tools.models import get_preset

MODELS = ("minimax-m3", "qwen3-235b-a22b", "deepseek-v3.2")
SIZES = (1, BLOCKS_PER_CHECK)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, action="append")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--trials", type=int, default=11)
    return parser.parse_args(argv)


def _rank(rank: int, model: str, tp: int, trials: int, path: str, rv: str, results: Any) -> None:
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        preset = get_preset(model)
        slots = 2 * BLOCKS_PER_CHECK
        layout = preset.layout(tp, preset.layers, slots, 32)
        group = gloo_group(rank, tp, rv)
        coord = dist.new_group(list(range(tp)))
        pools = [torch.zeros(n, dtype=torch.uint8) for n in layout.pool_sizes]
        config = {"model": model, "backend": "lmdb", "options": {"path": path}}
        conn = Connector(
            ConnectorConfig.from_dict({**config, "verify_replicas_every": 1}),
            layout,
            rank=rank,
            pools=pools,
            group=group,
        )
        plain = Connector(
            ConnectorConfig.from_dict({**config, "verify_replicas_every": 0}),
            layout,
            rank=rank,
            pools=pools,
            group=group,
        )
        times: dict[str, list[float]] = {}
        shared_bytes = sum(k.plan.page_size for k in conn.keys.shared)
        message = 1 + len(conn.keys.shared) + BLOCKS_PER_CHECK * items_per_block(conn.keys.shared)
        for trial in range(trials):
            base = 32 * BLOCKS_PER_CHECK * (trial + 1) * 1000
            hashes = block_hashes(list(range(base, base + 32 * BLOCKS_PER_CHECK)), 32)
            for slot, h in enumerate(hashes):
                compute_block(layout, rank, pools, h, slot)
            for n in SIZES:
                checked, index = conn.check_transfer(hashes[:n], list(range(n)))
                dist.barrier(group=coord)
                start = time.perf_counter()
                probes = conn._replicas.probes(
                    checked, index, conn._require_pools(), conn.device, WriterPolicy.SPREAD
                )
                probed = time.perf_counter()
                for probe in probes:
                    conn.check_replicas(probe)
                done = time.perf_counter()
                times.setdefault(f"probe{n}", []).append(probed - start)
                times.setdefault(f"check{n}", []).append(done - probed)
            dist.barrier(group=coord)
            start = time.perf_counter()
            group_ = conn.group
            assert group_ is not None
            group_.gather([0] * message)
            times.setdefault("all_gather", []).append(time.perf_counter() - start)
            dist.barrier(group=coord)
            start = time.perf_counter()
            assert plain.save(hashes, list(range(BLOCKS_PER_CHECK))).ok
            times.setdefault(f"save{BLOCKS_PER_CHECK}", []).append(time.perf_counter() - start)
        payload = {
            "times": times,
            "mismatch": conn.stats.replica_mismatch,
            "verified": conn.stats.replicas_verified,
            "shared_bytes": shared_bytes,
            "message": message,
        }
        conn.close()
        plain.close()
        dist.destroy_process_group()
        results.put((rank, payload))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"replica checks at TP={args.tp}, real layer counts, LMDB, {args.trials} trials")
    print(
        f"{'model':<16} {'shared/block':>12} {'msg':>5} {'probe 1':>9} {'check 1':>9} "
        f"{'probe 8':>9} {'check 8':>9} {'all_gather':>10} {'save 8':>9} {'per block':>10}"
    )
    for model in args.model or MODELS:
        layout = get_preset(model).layout(args.tp, 1, 1, 32)
        if not PageKeys({"model": model}, layout).shared:
            print(f"{model:<16} no page is held by several ranks at TP={args.tp}")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            store = os.path.join(tmp, "store")
            os.makedirs(store)
            out = run_ranks(
                _rank,
                args.tp,
                (model, args.tp, args.trials, store, os.path.join(tmp, "rv")),
                timeout_s=1800,
            )
        for payload in out:
            if "error" in payload:
                print(payload["error"], file=sys.stderr)
                return 1
        assert all(p["mismatch"] == 0 and p["verified"] > 0 for p in out)

        def slowest(name: str, out: list[dict[str, Any]] = out) -> float:
            per_trial = zip(*(p["times"][name] for p in out))
            return float(statistics.median(max(t) for t in per_trial)) * 1e3

        check1 = slowest("probe1") + slowest("check1")
        print(
            f"{model:<16} {out[0]['shared_bytes'] / 2**20:>9.2f} MiB {out[0]['message']:>5} "
            f"{slowest('probe1'):>7.2f}ms {slowest('check1'):>7.2f}ms "
            f"{slowest('probe8'):>7.2f}ms {slowest('check8'):>7.2f}ms "
            f"{slowest('all_gather'):>8.2f}ms {slowest('save8'):>7.2f}ms "
            f"{check1 / 1000 * 1e3:>8.2f}us"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
