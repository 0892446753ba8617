"""kvconn against SGLang's own HiCache storage backends, inside SGLang's HiCache controller.

SGLang serves nothing on these CPU machines, but its HiCache L3 path runs whole: the
harness of the adapter's tests (``contrib/sglang/tests/harness.py``) starts a TP group of
two processes, each with SGLang 0.5.23's real ``HiCacheController`` (its backup,
prefetch and I/O threads, its page hashing, its MIN all-reduces over gloo) over a host
pool, and the storage backend SGLang loads by name. Per configuration and trial, one
prompt's pages are backed up, asked for and loaded back, as the radix cache drives them;
only the GPU<->host copies are absent. Every configuration runs in the same two
processes, interleaved (the order turns each trial), on its own store.

The geometry is ``bench_engine_vllm.py``'s, Qwen2.5-0.5B: 24 layers, 2 KV heads of 64,
float32, at TP=2 (one head a rank); a 2,048-token prompt in 64-token pages (32 pages,
12 MiB per rank), ``page_first``. Figures, each the slower rank's, medians over trials:

* ``backup``: ``write_storage`` to the backup's acknowledgement (every page stored);
* ``query``: the hit query of the same prompt (``batch_exists``, then SGLang's MIN);
* ``load``: the prefetch of the hit into fresh host slots, to its completion ack.

Configurations (``--configs``):

* ``kvconn-lmdb``: kvconn on LMDB in a temporary directory;
* ``sglang-file``: SGLang's ``file`` backend (``HiCacheFile``) in a temporary directory,
  the one SGLang ships for a single host;
* ``kvconn-mooncake`` and ``sglang-mooncake``: kvconn's Mooncake backend and SGLang's own
  (``MooncakeStore``, zero-copy), against one Mooncake master with one storage process
  (``kvconn.tools.devserver``), TCP on loopback.

Run it in SGLang's environment with the stores' clients (``nox -s bench_sglang``)::

    nox -s bench_sglang -- --trials 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "contrib/sglang/tests"))

from harness import Case, run_cases  # type: ignore[import-not-found]  # noqa: E402

CONFIGS = ("kvconn-lmdb", "sglang-file", "kvconn-mooncake", "sglang-mooncake")
#: Figure -> the harness's timing of it, per rank.
FIGURES = {"backup": "seconds_backup", "query": "seconds_hit_query", "load": "seconds_load"}
#: The 24-layer, 2-KV-head, float32 geometry at TP=2: one head of 64 on each rank.
GEOMETRY = dict(layers=24, heads=1, kv_heads=2, head_dim=64, dtype="float32", layout="page_first")


def kvconn_extra(backend: str, options: dict[str, Any], namespace: str) -> dict[str, Any]:
    kvconn = {"model": "bench/model@rev", "namespace": namespace}
    return {
        "backend_name": "kvconn",
        "module_path": "kvconn_sglang",
        "class_name": "KvconnHiCacheStorage",
        "interface_v1": 1,
        "kvconn": kvconn | {"backend": backend, "options": options},
    }


def case(config: str, name: str, root: Path, pages: int, page: int, mooncake: Any) -> Case:
    """One prompt through one configuration, on a store of its own."""
    if config == "kvconn-lmdb":
        backend, extra = "dynamic", kvconn_extra("lmdb", {"path": str(root / name)}, name)
    elif config == "kvconn-mooncake":
        backend, extra = "dynamic", kvconn_extra("mooncake", dict(mooncake.options), name)
    elif config == "sglang-file":
        backend, extra = "file", {}
    else:  # sglang-mooncake: SGLang's own client, configured as kvconn's devserver's
        backend = "mooncake"
        extra = {
            "master_server_address": mooncake.master_address,
            "metadata_server": mooncake.metadata_server,
            "protocol": "tcp",
            "local_hostname": mooncake.host,
            "global_segment_size": 0,
            "extra_backend_tag": name,
        }
    return Case(name, backend=backend, extra_config=extra, pages=pages, page_size=page, **GEOMETRY)


@contextlib.contextmanager
def mooncake_cluster(needed: bool) -> Iterator[Any]:
    if not needed:
        yield None
        return
    from kvconn.tools.devserver.mooncake import MooncakeCluster

    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # the ranks' transfer engines too
    with MooncakeCluster(segment_size=1 << 30) as cluster:
        yield cluster


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if args.prompt_tokens % args.page_size:
        parser.error("--prompt-tokens must be a multiple of --page-size")
    pages = args.prompt_tokens // args.page_size
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    with (
        tempfile.TemporaryDirectory() as tmp,
        mooncake_cluster(any("mooncake" in c for c in args.configs)) as mooncake,
    ):
        root = Path(tmp)
        os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(root / "sglang-file")
        cases: list[tuple[str, Case]] = []
        for config in args.configs:  # warm-up: imports, SGLang's hash extension, clients
            cases.append(
                ("warm-up", case(config, f"warm-{config}", root, 2, args.page_size, mooncake))
            )
        for trial in range(args.trials):
            turn = trial % len(args.configs)
            for config in args.configs[turn:] + args.configs[:turn]:
                name = f"{config}-{trial}"
                cases.append((config, case(config, name, root, pages, args.page_size, mooncake)))
        results = run_cases([c for _, c in cases], timeout_s=3600)
    figures: dict[str, dict[str, list[float]]] = {c: {f: [] for f in FIGURES} for c in args.configs}
    for (config, c), ranks in zip(cases, results):
        for r in ranks:
            if "error" in r:
                raise SystemExit(f"{c.name} failed on rank {r['rank']}:\n{r['error']}")
            if r["loaded_tokens"] != c.pages * c.page_size or not all(r["pages_equal"]):
                raise SystemExit(f"{c.name}: rank {r['rank']} did not load every page intact")
        if config == "warm-up":
            continue
        for figure in FIGURES:
            figures[config][figure].append(max(r[FIGURES[figure]] for r in ranks))
    medians = {c: {f: statistics.median(v) for f, v in fs.items()} for c, fs in figures.items()}
    print(
        f"\n{args.prompt_tokens}-token prompt, {pages} pages of {args.page_size} tokens, TP=2, "
        f"24 layers x 1 KV head of 64 per rank, float32; medians of {args.trials} trials (ms)"
    )
    print(f"{'configuration':<18}" + "".join(f"{f:>10}" for f in FIGURES))
    for config, fs in medians.items():
        print(f"{config:<18}" + "".join(f"{fs[f] * 1e3:>10.1f}" for f in FIGURES))
    for mine, theirs in (("kvconn-lmdb", "sglang-file"), ("kvconn-mooncake", "sglang-mooncake")):
        if mine in medians and theirs in medians:
            ratios = "  ".join(f"{f} {medians[mine][f] / medians[theirs][f]:.2f}x" for f in FIGURES)
            print(f"{mine} / {theirs}: {ratios}")
    if args.json:
        Path(args.json).write_text(json.dumps({"medians": medians, "trials": figures}, indent=1))


if __name__ == "__main__":
    main()
