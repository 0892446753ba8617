"""A scheduler's prefix lookup on LMDB: asked on its own thread or through a lookup thread.

The geometry is the vLLM benchmark's (``bench_engine_vllm.py``): Qwen2.5-0.5B's 24
layers, 2 KV heads, fp32, 32 tokens per block; a 2,048-token prompt asks for 63 blocks,
one key per block at TP=1 and two (a shard per KV head) at TP=2. A lookup is
``DeadlineLookup.ask`` as vLLM's ``get_num_new_matched_tokens`` calls it, with the
default ``lookup_wait_s``, asked again at once while it answers "ask again later":

* ``inline``: on the asking thread, which LMDB gets (``Capabilities.local``);
* ``thread``: handed to the lookup thread and waited for, as a store across a network
  is asked (what LMDB got before it declared ``local``);
* ``plain``: ``Lookup.lookup`` itself, the work both variants wrap.

Two sections:

``warm``  one process, every variant once per trial in a new shuffled order, medians;
          ``miss`` asks for blocks never stored, ``hit`` for the 63 stored ones.
``fresh`` a new process per trial, alternating the two variants: the first three
          lookups of a process that has made its ``DeadlineLookup`` and asked nothing
          yet, as in an engine that has just started (vLLM's first request is a miss).

    python -m benchmarks.bench_lookup
    python -m benchmarks.bench_lookup --section fresh --fresh-trials 31
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from benchmarks.bench_movement import interleaved_medians
from kvconn.hashing import block_hashes
from kvconn.layout import KvLayout
from kvconn.lookup import DeadlineLookup, Lookup
from kvconn.tools.models import RoleSpec, interleaved_layout

LAYERS = 24
KV_HEADS = 2
HEAD_DIM = 64
BLOCKS = 63
TOKENS = 32


def layout(tp: int) -> KvLayout:
    per_rank = 2 * (KV_HEADS // tp) * HEAD_DIM * 4  # K and V, fp32
    role = RoleSpec("kv", per_rank, KV_HEADS, "float32")
    return interleaved_layout([role], tp_size=tp, layers=LAYERS, num_slots=BLOCKS + 1)


def config(path: str) -> dict[str, object]:
    return {"model": "bench-lookup", "backend": "lmdb", "options": {"path": path}}


def hashes(seed: int) -> list[bytes]:
    return block_hashes(list(range(seed, seed + BLOCKS * TOKENS)), TOKENS)


def fill(path: str, tp: int) -> list[bytes]:
    """Store every key a lookup of the 63 blocks checks; their hashes.

    The values are 4 KiB: an ``exists`` reads no value, and a value this size already
    lives on overflow pages, as the real 384-768 KiB pages do."""
    stored = hashes(0)
    with Lookup(config(path), layout(tp)) as lookup:
        keys = [k for block in lookup.keys.lookup_keys(stored) for k in block]
        lookup.backend.put(keys, [bytes(4096)] * len(keys))
    return stored


def answer(asker: DeadlineLookup, tag: object, asked: list[bytes]) -> int:
    """Ask until answered, as a scheduler that asks every step would (but without the
    steps between); the blocks hit."""
    while True:
        result = asker.ask(tag, asked)
        if result is not None:
            return result.blocks


def warm(path: str, tp: int, trials: int) -> None:
    stored = fill(path, tp)
    missing = hashes(10**6)
    lookup = Lookup(config(path), layout(tp))
    inline = DeadlineLookup(lookup)
    thread = DeadlineLookup(lookup)
    thread.inline = False
    assert inline.inline, "LMDB no longer declares itself local"
    tags = iter(range(10**9))
    variants: dict[str, Callable[[], object]] = {}
    for kind, asked, want in (("miss", missing, 0), ("hit", stored, BLOCKS)):

        def plain(asked: list[bytes] = asked, want: int = want) -> None:
            assert lookup.lookup(asked).blocks == want

        variants[f"{kind}, plain"] = plain
        for name, asker in (("inline", inline), ("thread", thread)):

            def ask(
                asker: DeadlineLookup = asker, asked: list[bytes] = asked, want: int = want
            ) -> None:
                assert answer(asker, next(tags), asked) == want

            variants[f"{kind}, {name}"] = ask
    medians = interleaved_medians(variants, trials)
    keys = len(lookup.keys.lookup_keys(stored[:1])[0]) * BLOCKS
    print(f"warm, TP={tp}: {BLOCKS} blocks, {keys} keys per lookup, {trials} trials, medians")
    for kind in ("miss", "hit"):
        ms = {v: medians[f"{kind}, {v}"] * 1e3 for v in ("plain", "inline", "thread")}
        print(
            f"  {kind:4}  plain {ms['plain']:.3f} ms  inline {ms['inline']:.3f} ms  "
            f"thread {ms['thread']:.3f} ms  inline/thread {ms['inline'] / ms['thread']:.2f}"
        )
    thread.close()
    inline.close()
    lookup.close()


def child(path: str, tp: int, variant: str) -> None:
    """One fresh process: the first three lookups (two misses, then the stored hit)."""
    asker = DeadlineLookup(Lookup(config(path), layout(tp)))
    asker.inline = variant == "inline"
    times = []
    for i, asked in enumerate((hashes(10**6), hashes(2 * 10**6), hashes(0))):
        start = time.perf_counter()
        answer(asker, i, asked)
        times.append(time.perf_counter() - start)
    print(json.dumps(times))


def fresh(path: str, tp: int, trials: int) -> None:
    fill(path, tp)
    runs: dict[str, list[list[float]]] = {"inline": [], "thread": []}
    for i in range(trials):
        for variant in ("inline", "thread") if i % 2 == 0 else ("thread", "inline"):
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.bench_lookup", "--child", variant,
                 "--tp", str(tp), "--path", path],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            runs[variant].append(json.loads(out.stdout.splitlines()[-1]))
    print(f"fresh process, TP={tp}: {trials} processes per variant, medians (ms)")
    firsts = {}
    for variant, rows in runs.items():
        cols = [statistics.median(col) * 1e3 for col in zip(*rows)]
        firsts[variant] = cols[0]
        print(
            f"  {variant:6}  1st (miss) {cols[0]:.3f}  2nd (miss) {cols[1]:.3f}  "
            f"3rd (hit) {cols[2]:.3f}"
        )
    print(f"  first lookup, inline/thread {firsts['inline'] / firsts['thread']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--section", choices=("warm", "fresh", "all"), default="all")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], choices=(1, 2))
    parser.add_argument("--trials", type=int, default=301, help="warm trials (301)")
    parser.add_argument("--fresh-trials", type=int, default=21, help="processes per variant")
    parser.add_argument("--child", choices=("inline", "thread"), help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.path, args.tp[0], args.child)
        return
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    for tp in args.tp:
        for section, run, trials in (("warm", warm, args.trials),
                                     ("fresh", fresh, args.fresh_trials)):  # fmt: skip
            if args.section in (section, "all"):
                with tempfile.TemporaryDirectory() as path:
                    run(path, tp, trials)


if __name__ == "__main__":
    main()
