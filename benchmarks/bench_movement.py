"""Gather/scatter bandwidth of page assembly, as a ratio to a plain contiguous copy.

The pool is interleaved the way MiniMax-M3's is (K, V and index-K of every layer inside
one slot), so the sharded K/V page and the replicated index-K page are both assembled
from strided pieces. The baseline copies the same number of bytes between two
contiguous tensors in the same run, so the ratio is meaningful on a noisy machine.

    python benchmarks/bench_movement.py            # 64 KiB .. 1 MiB pages
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from kvconn.movement import PageMover
from kvconn.plan import plan_pages
from kvconn.tools.models import RoleSpec, interleaved_layout


def best_of(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--page-kib",
        type=int,
        nargs="+",
        default=[64, 256, 1024],
        help="K/V page sizes to measure (KiB)",
    )
    parser.add_argument("--batch-mib", type=int, default=64, help="bytes moved per measurement")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    roles = (
        RoleSpec("k", 256, 8, "bf16"),
        RoleSpec("v", 256, 8, "bf16"),
        RoleSpec("index_k", 256, 1, "bf16"),
    )
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(
        f"{'page':>9} {'kind':>10} {'copy GB/s':>10} {'gather GB/s':>12} {'ratio':>6} "
        f"{'scatter GB/s':>13} {'ratio':>6}"
    )
    ratios = []
    for kib in args.page_kib:
        layers = max(1, kib * 1024 // (512 * 32))  # a K/V page is 16 KiB per layer
        n = max(1, args.batch_mib * 2**20 // (kib * 1024))
        num_slots = 2 * n
        layout = interleaved_layout(roles, tp_size=8, layers=layers, num_slots=num_slots)
        pool = torch.randint(0, 256, (layout.pool_sizes[0],), dtype=torch.uint8)
        slots = torch.randperm(num_slots)[:n]
        for plan in plan_pages(layout):
            mover = PageMover(plan.regions, [pool], num_slots)
            pages = torch.empty(n, plan.page_size, dtype=torch.uint8)
            src = torch.randint(0, 256, (n, plan.page_size), dtype=torch.uint8)
            dst = torch.empty_like(src)
            nbytes = pages.numel()
            t_copy = best_of(functools.partial(dst.copy_, src), args.repeat)
            t_gather = best_of(functools.partial(mover.gather, slots, pages), args.repeat)
            t_scatter = best_of(functools.partial(mover.scatter, slots, pages), args.repeat)
            g, s, c = nbytes / t_gather / 1e9, nbytes / t_scatter / 1e9, nbytes / t_copy / 1e9
            ratios += [g / c, s / c]
            label = f"{plan.page_size // 1024} KiB"
            print(
                f"{label:>9} {plan.shard_class.label:>10} {c:10.2f} {g:12.2f} {g / c:6.2f} "
                f"{s:13.2f} {s / c:6.2f}"
            )
    print(
        f"min ratio {min(ratios):.2f}, median ratio {statistics.median(ratios):.2f} (target >= 0.5)"
    )


if __name__ == "__main__":
    main()
