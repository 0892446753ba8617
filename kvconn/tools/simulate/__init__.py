"""Run a tensor-parallel serving workload against a store, verify every load, report the footprint.

Each TP rank is its own process with its own KV pool (laid out as the model preset lays
it out) and its own connector built from the configuration, so every backend runs
through exactly the code path an engine would use. A seeded chat workload (shared
system prompts, multi-turn conversations) is replayed; per request the group does one
lookup, every rank loads the hit blocks, verifies them byte for byte against
recomputation, computes the rest and saves its designated pages. The report compares
the bytes stored with per-rank keying and with the reference connector's scheme.

Quick start (embedded LMDB store, no server; ~8 s on a 2-core machine):

    kvconn simulate                          # minimax-m3, TP=8, 2 layers
    kvconn simulate                          # again: hits what the first run stored
    kvconn simulate --model deepseek-v3.2 --json
    kvconn inspect                           # the store's footprint
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvconn.errors import ConfigError
from kvconn.plan import plan_pages
from kvconn.tools.models import PRESETS, Preset, get_preset, load_preset
from kvconn.tools.store_options import add_store_arguments, connector_config

DEFAULT_MODEL = "minimax-m3"
DEFAULT_LAYERS = 2

__all__ = ["add_arguments", "run", "settings_from_args"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"model preset: {', '.join(sorted(PRESETS))} (default {DEFAULT_MODEL})",
    )
    model.add_argument(
        "--layout",
        metavar="FILE",
        default=None,
        help="a custom layout TOML instead of a preset (format: docs/simulate.md)",
    )
    model.add_argument("--tp", type=int, default=8, help="tensor-parallel size (default 8)")
    model.add_argument(
        "--layers",
        default=str(DEFAULT_LAYERS),
        help=f"layers to simulate, or 'all' for the model's real count (default "
        f"{DEFAULT_LAYERS}: bytes per layer are what the figures depend on, and few "
        "layers keep the run fast)",
    )
    model.add_argument("--tokens-per-block", type=int, default=32, help="default 32")
    model.add_argument(
        "--shard-heads",
        type=int,
        default=None,
        metavar="G",
        help="cut head-sharded pages at G shards of the heads (w<G>r<j>), so runs at "
        "different --tp (dividing G) share pages: the configuration's shard_heads "
        "(default: unset, each TP size cuts its own shards)",
    )
    model.add_argument(
        "--policy",
        choices=("spread", "first"),
        default=None,
        help="writer of replicated pages: spread over replicas by block hash (default) "
        "or always the first replica",
    )
    work = parser.add_argument_group("workload (seeded: the same flags replay the same tokens)")
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--conversations", type=int, default=12, help="default 12")
    work.add_argument("--turns", type=int, default=4, help="most turns per conversation (4)")
    work.add_argument("--system-prompts", type=int, default=3, help="shared system prompts (3)")
    work.add_argument("--system-tokens", default="256:1024", metavar="MIN:MAX")
    work.add_argument("--user-tokens", default="32:256", metavar="MIN:MAX")
    work.add_argument("--reply-tokens", default="64:320", metavar="MIN:MAX")
    work.add_argument("--concurrency", type=int, default=4, help="conversations open at once (4)")
    work.add_argument("--salt", default="", help="cache salt (reuse scope) of every request")
    run_group = parser.add_argument_group("run")
    run_group.add_argument(
        "--evict-rate",
        type=float,
        default=0.0,
        metavar="P",
        help="fault injection: with probability P per request, delete one page of a hit "
        "block between the lookup and the load (needs a backend that can delete)",
    )
    run_group.add_argument(
        "--no-stripe",
        dest="stripe",
        action="store_false",
        help="every rank reads every page it loads from the store; by default the ranks "
        "form a gloo group and read each page several of them hold once per group, "
        "passing it to the others over the group",
    )
    run_group.add_argument(
        "--verify-replicas-every",
        type=int,
        default=None,
        metavar="N",
        help="over the gloo group, compare the pages several ranks hold across them at "
        "the first save and for 1 saved block in N (configuration verify_replicas_every, "
        "default 1000; 0: never)",
    )
    run_group.add_argument(
        "--inject-mismatch",
        metavar="ROLE:RANK",
        default=None,
        help="fault injection: rank RANK computes role ROLE differently from the ranks it "
        "shares it with (e.g. index_k:1); replica checks should name it and key that "
        "page kind per rank (use a store without this model's earlier pages: loads before "
        "the first check read them, and the report counts those as errors)",
    )
    run_group.add_argument(
        "--start-method",
        choices=("forkserver", "spawn"),
        default=None,
        help="how rank processes start (default forkserver where available, else spawn)",
    )
    run_group.add_argument("--json", action="store_true", help="print one JSON object")
    progress = run_group.add_mutually_exclusive_group()
    progress.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="show the progress bar even when stderr is not a terminal",
    )
    progress.add_argument("--no-progress", dest="progress", action="store_false")
    add_store_arguments(parser)


def _preset(args: argparse.Namespace) -> Preset:
    return load_preset(args.layout) if args.layout else get_preset(args.model)


def _layers(text: str, preset: Preset) -> int:
    if text == "all":
        return preset.layers
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"--layers expects a number or 'all', got {text!r}") from None
    return preset.resolve_layers(value)


def _mismatch(text: str | None) -> tuple[str, int] | None:
    """``--inject-mismatch ROLE:RANK`` as ``(role, rank)``."""
    if text is None:
        return None
    role, sep, rank = text.rpartition(":")
    if not sep or not role or not rank.isdigit():
        raise ConfigError(f"--inject-mismatch expects ROLE:RANK (e.g. index_k:1), got {text!r}")
    return role, int(rank)


def settings_from_args(args: argparse.Namespace) -> Any:
    """Validated :class:`~kvconn.tools.simulate.runner.SimSettings` from parsed arguments."""
    import multiprocessing

    from kvconn.tools.simulate.runner import SimSettings
    from kvconn.tools.simulate.workload import WorkloadSpec, parse_range

    preset = _preset(args)
    layers = _layers(args.layers, preset)
    overrides: dict[str, Any] = {"writer_policy": args.policy} if args.policy else {}
    if args.verify_replicas_every is not None:
        overrides["verify_replicas_every"] = args.verify_replicas_every
    if args.shard_heads is not None:
        overrides["shard_heads"] = args.shard_heads
    config = connector_config(args, preset.name, overrides)
    workload = WorkloadSpec(
        seed=args.seed,
        conversations=args.conversations,
        turns=args.turns,
        system_prompts=args.system_prompts,
        system_tokens=parse_range(args.system_tokens),
        user_tokens=parse_range(args.user_tokens),
        reply_tokens=parse_range(args.reply_tokens),
        concurrency=args.concurrency,
    )
    start_method = args.start_method or (
        "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    )
    settings = SimSettings(
        preset=preset,
        config=config,
        tp_size=args.tp,
        layers=layers,
        tokens_per_block=args.tokens_per_block,
        workload=workload,
        evict_rate=args.evict_rate,
        start_method=start_method,
        salt=args.salt,
        stripe=args.stripe,
        mismatch=_mismatch(args.inject_mismatch),
    )
    layout = preset.layout(settings.tp_size, layers, 1, settings.tokens_per_block)  # units
    plan_pages(layout, config.checksum, config.shard_heads)  # fail fast on shard_heads
    return settings


def run(args: argparse.Namespace) -> int:
    """Exit status 0 when every loaded page verified, 1 when any did not."""
    from kvconn.tools.simulate.report import format_report
    from kvconn.tools.simulate.runner import simulate

    settings = settings_from_args(args)
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    report = simulate(settings, progress=sys.stderr if show else None)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 1 if report["errors"] else 0
