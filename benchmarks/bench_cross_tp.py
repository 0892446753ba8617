"""Pages cut at ``shard_heads`` against pages cut at each TP size's own shard: the cost.

With ``shard_heads = G`` a rank at TP ``t`` holds ``G / t`` head-shard pages per block
where it held one page of its own shard: the same bytes in more, smaller pages. This
measures what that costs one rank, side by side in one run, for a model with 8 KV heads
(Llama-3.1-70B's geometry, ``--layers`` of its 80 layers) at TP = 8, 4, 2 and 1:

* pages and payload bytes per block the rank loads (and keys a group-wide lookup asks);
* the rank's load time per block (``Connector.load`` of ``--blocks`` blocks: read,
  checksum, scatter), and its lookup time per block (one batched ``exists`` of every
  page any rank loads), medians over ``--trials`` trials after a warm-up, the two kinds
  interleaved in alternating order. Wall time, and the calling thread's CPU time: on a
  machine shared with other work the CPU time is the steadier figure, and the ratios
  (g8 / own) are of it. With Redis the server's own CPU time is not in it.

Every load must load every block and is verified byte for byte against what was saved.
Stores: LMDB in a temporary directory, and a redis-server on a free loopback port
(``kvconn.tools.devserver``; ``--backend lmdb`` alone needs none).

    python benchmarks/bench_cross_tp.py
    python benchmarks/bench_cross_tp.py --backend redis --layers 16 --trials 9

The alternative to finer pages, a TP=8 reader taking half of each TP=4 page by a ranged
read, is not measured: the backend contract has no ranged read, a page spanning many
layers would need one range per region, and the checksum covers the whole page, so a
reader that verifies must read all of it -- the TP=4 rows' bytes, twice the TP=8 ones.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

from kvconn.config import ConnectorConfig
from kvconn.connector import Connector
from kvconn.hashing import block_hashes
from kvconn.tools.devserver.redis import RedisServer
from kvconn.tools.models import get_preset

MODEL = "llama-3.1-70b"
G = 8
BACKENDS = ("lmdb", "redis")
KINDS = ("own", "g8")  # pages cut at the TP size's own shard / at G head shards


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--tp", nargs="+", type=int, default=[8, 4, 2, 1])
    parser.add_argument("--layers", type=int, default=8, help="layers per block (8)")
    parser.add_argument("--blocks", type=int, default=32, help="blocks per load (32)")
    parser.add_argument("--trials", type=int, default=7, help="loads of each kind (7)")
    return parser.parse_args(argv)


class Case:
    """One TP size and one kind of page: rank 0's connector, its pool and what it saved."""

    def __init__(self, tp: int, kind: str, options: dict[str, Any], args: argparse.Namespace):
        self.tp, self.kind = tp, kind
        self.blocks = args.blocks
        self.layout = get_preset(MODEL).layout(tp, args.layers, 2 * args.blocks, 32)
        config = ConnectorConfig.from_dict(
            {
                "model": f"bench-{tp}-{kind}",  # each case its own keys
                "backend": options.pop("_backend"),
                "options": options,
                "shard_heads": G if kind == "g8" else None,
            }
        )
        gen = torch.Generator().manual_seed(tp)
        self.pool = torch.randint(
            -128, 128, (self.layout.pool_sizes[0],), dtype=torch.int8, generator=gen
        ).view(torch.uint8)
        self.hashes = block_hashes(list(range(tp, tp + 32 * args.blocks)), 32)
        self.saved = list(range(args.blocks))
        self.loaded_slots = list(range(args.blocks, 2 * args.blocks))
        # every rank's pages, so that the lookup finds whole blocks (rank 0's bytes stand
        # in for the others': only rank 0 loads and is verified)
        self.conns = [
            Connector(config, self.layout, rank=rank, pools=[self.pool]) for rank in range(tp)
        ]
        for conn in self.conns:
            assert conn.save(self.hashes, self.saved).ok
        self.conn = self.conns[0]
        self.load_s: list[float] = []
        self.load_cpu_s: list[float] = []
        self.lookup_s: list[float] = []
        self.lookup_cpu_s: list[float] = []

    def reset(self) -> None:
        for times in (self.load_s, self.load_cpu_s, self.lookup_s, self.lookup_cpu_s):
            times.clear()

    @property
    def pages_per_block(self) -> int:
        return len(self.conn.shares)

    @property
    def bytes_per_block(self) -> int:
        return sum(share.plan.page_size for share in self.conn.shares)

    @property
    def lookup_keys_per_block(self) -> int:
        return len(self.conn.keys.block_keys(self.hashes[0]))

    def trial(self) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        assert self.conn.lookup(self.hashes).blocks == self.blocks
        self.lookup_s.append((time.perf_counter() - start) / self.blocks)
        self.lookup_cpu_s.append((time.thread_time() - cpu) / self.blocks)
        self._clear()
        start, cpu = time.perf_counter(), time.thread_time()
        result = self.conn.load(self.hashes, self.loaded_slots)
        self.load_s.append((time.perf_counter() - start) / self.blocks)
        self.load_cpu_s.append((time.thread_time() - cpu) / self.blocks)
        assert result.loaded == self.blocks, result
        assert self._verified(), f"TP={self.tp} {self.kind}: loaded bytes differ"

    def _rows(self, slots: list[int]) -> list[torch.Tensor]:
        out = []
        for region in self.layout.groups[0].regions:
            rows = self.pool.as_strided(
                (region.num_slots, region.size), (region.stride, 1), region.base
            )
            out.append(rows[torch.tensor(slots)])
        return out

    def _clear(self) -> None:
        for region in self.layout.groups[0].regions:
            rows = self.pool.as_strided(
                (region.num_slots, region.size), (region.stride, 1), region.base
            )
            rows[torch.tensor(self.loaded_slots)] = 0

    def _verified(self) -> bool:
        return all(
            torch.equal(a, b) for a, b in zip(self._rows(self.saved), self._rows(self.loaded_slots))
        )

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


@contextlib.contextmanager
def store(name: str) -> Iterator[dict[str, Any]]:
    """A fresh store of ``name`` and the options its connectors use."""
    if name == "lmdb":
        with tempfile.TemporaryDirectory(prefix="kvconn-bench-") as path:
            yield {"_backend": "lmdb", "path": path, "map_size": 4 << 30}
    else:
        with RedisServer() as server:
            yield {"_backend": "redis", **server.options}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # one rank's thread, as an engine's transfer thread runs
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, python {sys.version.split()[0]}; "
        f"{MODEL} geometry (8 KV heads, 256 B/token per head for K and V), {args.layers} "
        f"layers, {args.blocks} blocks of 32 tokens per load, {args.trials} trials, medians; "
        f"one rank (rank 0) of each TP size; pages cut at its own shard (own) or at "
        f"G = {G} head shards (g8)"
    )
    print(
        f"{'':>15} {'per block':>31} {'load us/blk':>20} {'lookup us/blk':>20}\n"
        f"{'store':>6} {'TP':>3} {'kind':>4} {'pages':>6} {'KiB':>6} {'lookup keys':>12} "
        f"{'wall':>6} {'CPU':>6} {'ratio':>6} {'wall':>6} {'CPU':>6} {'ratio':>6}"
    )
    for backend in args.backend:
        with store(backend) as options:
            for tp in args.tp:
                cases = {kind: Case(tp, kind, dict(options), args) for kind in KINDS}
                try:
                    for case in cases.values():  # warm-up, not counted
                        case.trial()
                        case.reset()
                    for trial in range(args.trials):
                        for kind in KINDS if trial % 2 == 0 else KINDS[::-1]:
                            cases[kind].trial()
                    own = cases["own"]
                    for kind in KINDS:
                        case = cases[kind]
                        med = statistics.median
                        load_cpu, lookup_cpu = med(case.load_cpu_s), med(case.lookup_cpu_s)
                        print(
                            f"{backend:>6} {tp:>3} {kind:>4} {case.pages_per_block:>6} "
                            f"{case.bytes_per_block / 1024:>6.0f} "
                            f"{case.lookup_keys_per_block:>12} "
                            f"{med(case.load_s) * 1e6:>6.0f} {load_cpu * 1e6:>6.0f} "
                            f"{load_cpu / med(own.load_cpu_s):>6.2f} "
                            f"{med(case.lookup_s) * 1e6:>6.1f} {lookup_cpu * 1e6:>6.1f} "
                            f"{lookup_cpu / med(own.lookup_cpu_s):>6.2f}",
                            flush=True,
                        )
                finally:
                    for case in cases.values():
                        case.close()


if __name__ == "__main__":
    main()
