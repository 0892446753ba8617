"""Gather/scatter bandwidth of page assembly, as a ratio to a plain contiguous copy.

The pool is interleaved the way MiniMax-M3's is (K, V and index-K of every layer inside
one slot), so the sharded K/V page and the replicated index-K page are both assembled
from strided pieces. The baseline copies the same number of bytes between two
contiguous tensors in the same run, so the ratio is meaningful on a noisy machine: every
trial times copy, gather and scatter once each in a shuffled order, and the ratios are
of the medians over trials.

    python benchmarks/bench_movement.py            # 16 KiB .. 1 MiB pages
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from collections.abc import Callable, Mapping

import torch

from kvconn.movement import PageMover
from kvconn.plan import plan_pages
from kvconn.tools.models import RoleSpec, interleaved_layout


def interleaved_medians(
    variants: Mapping[str, Callable[[], object]], trials: int
) -> dict[str, float]:
    """Median seconds of each variant over trials that run every variant once, shuffled.

    Interleaving spreads a noisy neighbour's bursts over all variants alike, so their
    ratios stay meaningful where best-of-N of one variant after another does not.
    """
    for fn in variants.values():
        fn()  # warm-up: first-touch page faults and allocator growth are not the copy
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for _ in range(trials):
        random.shuffle(names)
        for name in names:
            t0 = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def torch_scatter(mover: PageMover, slots: torch.Tensor, pages: torch.Tensor) -> None:
    """The scatter kvconn used before numpy: torch's ``index_copy_`` per run (reference)."""
    for i, view in enumerate(mover._views):
        words = mover._as_words(mover._page_bytes(pages, i), i, writable=False)
        assert words is not None
        view.index_copy_(0, slots, words)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--page-kib",
        type=int,
        nargs="+",
        default=[16, 32, 64, 256, 1024],
        help="K/V page sizes to measure (KiB)",
    )
    parser.add_argument("--batch-mib", type=int, default=64, help="bytes moved per measurement")
    parser.add_argument("--trials", type=int, default=15, help="interleaved trials per size")
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
        f"{'scatter GB/s':>13} {'ratio':>6} {'index_copy_ ratio':>18}"
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
            med = interleaved_medians(
                {
                    "copy": functools.partial(dst.copy_, src),
                    "gather": functools.partial(mover.gather, slots, pages),
                    "scatter": functools.partial(mover.scatter, slots, pages),
                    "index_copy_": functools.partial(torch_scatter, mover, slots, pages),
                },
                args.trials,
            )
            t_copy, t_gather, t_scatter = med["copy"], med["gather"], med["scatter"]
            old = t_copy / med["index_copy_"]
            g, s, c = nbytes / t_gather / 1e9, nbytes / t_scatter / 1e9, nbytes / t_copy / 1e9
            ratios += [g / c, s / c]
            label = f"{plan.page_size // 1024} KiB"
            print(
                f"{label:>9} {plan.shard_class.label:>10} {c:10.2f} {g:12.2f} {g / c:6.2f} "
                f"{s:13.2f} {s / c:6.2f} {old:18.2f}"
            )
    print(
        f"min ratio {min(ratios):.2f}, median ratio {statistics.median(ratios):.2f} (target >= 0.5)"
    )


if __name__ == "__main__":
    main()
