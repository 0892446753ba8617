"""Run a local store for development: loopback only, free ports, Ctrl-C stops it.

``kvconn dev-server redis`` starts one redis-server (or a Redis Cluster with
``--cluster N``); ``kvconn dev-server mooncake`` starts a Mooncake master and standalone
storage processes, so data outlives short-lived clients. Each prints the backend options
to put in a kvconn configuration. A bad flag is one line naming it, and exit code 2.

The servers need ``pip install 'kvconn[devserver]'``; they are imported only when one
is run, so ``kvconn --help`` works without them.
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kvconn.errors import ConfigError
from kvconn.tools.devserver import DEVSERVER_EXTRA, MIN_CLUSTER_NODES, MIN_SEGMENT_SIZE, byte_size

_MAX_PORT = 65535


class _Parser(argparse.ArgumentParser):
    """A bad flag gets one line naming the flag and its value (not the usage), exit 2."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message}\n")


T = TypeVar("T")


def _flag_type(convert: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type`` whose ValueError becomes ``argument --flag: 'value': why``."""

    @functools.wraps(convert)
    def parse(text: str) -> T:
        try:
            return convert(text)
        except (ValueError, OSError) as exc:
            named = repr(text) in str(exc)
            raise argparse.ArgumentTypeError(str(exc) if named else f"{text!r}: {exc}") from None

    return parse


def _whole(text: str, low: int, high: int | None = None) -> int:
    if not text.strip().lstrip("+-").isdigit():
        raise ValueError("not a whole number")
    value = int(text)
    if value < low or (high is not None and value > high):
        raise ValueError(f"must be {low}..{high}" if high is not None else f"must be >= {low}")
    return value


@_flag_type
def _port(text: str) -> int:
    return _whole(text, 1, _MAX_PORT)


@_flag_type
def _at_least_one(text: str) -> int:
    return _whole(text, 1)


@_flag_type
def _cluster_nodes(text: str) -> int:
    nodes = _whole(text, 0)
    if 0 < nodes < MIN_CLUSTER_NODES:
        raise ValueError(f"a Redis Cluster needs at least {MIN_CLUSTER_NODES} nodes")
    return nodes


_size = _flag_type(byte_size)


@_flag_type
def _segment_size(text: str) -> int:
    size = byte_size(text)
    if size < MIN_SEGMENT_SIZE:
        raise ValueError("below the 16 MiB a Mooncake storage process needs")
    return size


@_flag_type
def _local_address(text: str) -> str:
    """An address of this machine: what the master and storage processes can bind."""
    with socket.socket() as probe:
        probe.bind((text, 0))
    return text


@_flag_type
def _directory(text: str) -> Path:
    path = Path(text)
    path.mkdir(parents=True, exist_ok=True)  # fails on a file, or under one
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="store", metavar="STORE", required=True, parser_class=_Parser)
    redis = sub.add_parser(
        "redis",
        help="one redis-server, or a Redis Cluster",
        description="Start redis-server on 127.0.0.1 with persistence off.",
    )
    redis.add_argument("--port", type=_port, help="port (default: a free one)")
    redis.add_argument(
        "--maxmemory", type=_size, help="evict beyond this size, e.g. 1gb (binary units)"
    )
    redis.add_argument("--maxmemory-policy", help="e.g. allkeys-lru; redis-server checks it")
    redis.add_argument(
        "--cluster",
        type=_cluster_nodes,
        default=0,
        metavar="N",
        help=f"an N-node Redis Cluster, N >= {MIN_CLUSTER_NODES}",
    )
    moon = sub.add_parser(
        "mooncake",
        help="a Mooncake master and storage processes",
        description="Start mooncake_master and standalone storage processes on free ports.",
    )
    moon.add_argument("--storage-processes", type=_at_least_one, default=1, help="how many (1)")
    moon.add_argument(
        "--segment-size",
        type=_segment_size,
        default="256MiB",
        help="memory per storage process, e.g. 1GiB (256MiB)",
    )
    moon.add_argument("--host", type=_local_address, default="127.0.0.1", help="address to bind")
    moon.add_argument("--client-ttl", type=_at_least_one, help="master --client_ttl seconds (10)")
    moon.add_argument("--log-dir", type=_directory, help="keep logs here (default: a temp dir)")
    moon.add_argument("master_args", nargs="*", help="extra mooncake_master flags (after --)")
    for store in (redis, moon):
        store.add_argument("--json", action="store_true", help="print the options as one JSON line")


def run(args: argparse.Namespace) -> int:
    """Start the server, print how to reach it, keep it up until Ctrl-C or SIGTERM."""
    try:
        from kvconn.tools.devserver._process import StartError

        server = _redis(args) if args.store == "redis" else _mooncake(args)
    except ImportError as exc:
        raise ConfigError(
            f"kvconn dev-server needs the Python module {exc.name!r}: "
            f"pip install 'kvconn[{DEVSERVER_EXTRA}]'"
        ) from None
    # SIGTERM takes Ctrl-C's path: an interrupt wherever the main thread is, so it
    # stops a server that is still starting as promptly as one that is serving.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        problem = type(server).available()
        if problem is not None:
            print(f"{args.store} dev server unavailable: {problem}", file=sys.stderr)
            return 1
        with server:  # a start interrupted or failed half-way stops what it started
            _announce(args.store, server, as_json=args.json)
            while server.running:
                time.sleep(0.5)
            print(f"{args.store} dev server exited; stopping", file=sys.stderr)
            return 1
    except StartError as exc:
        if exc.rejected is not None:
            raise ConfigError(exc.rejected) from None
        raise
    except KeyboardInterrupt:
        return 0  # the servers are stopped: Ctrl-C is the normal way out
    finally:
        signal.signal(signal.SIGTERM, previous)


def _redis(args: argparse.Namespace) -> Any:
    from kvconn.tools.devserver.redis import RedisCluster, RedisServer

    settings = {"maxmemory": args.maxmemory, "maxmemory_policy": args.maxmemory_policy}
    if not args.cluster:
        return RedisServer(args.port, **settings)
    if args.port is not None:
        raise ConfigError(f"--port {args.port}: a cluster picks its nodes' ports itself")
    return RedisCluster(args.cluster, **settings)


def _mooncake(args: argparse.Namespace) -> Any:
    from kvconn.tools.devserver.mooncake import MooncakeCluster

    return MooncakeCluster(
        storage_processes=args.storage_processes,
        segment_size=args.segment_size,
        host=args.host,
        master_args=args.master_args,
        client_ttl=args.client_ttl,
        log_dir=args.log_dir,
    )


def _announce(store: str, server: Any, *, as_json: bool) -> None:
    """Tell the user (or a script reading one JSON line) how to reach ``server``."""
    if as_json:
        print(json.dumps(server.options), flush=True)
        return
    if store == "mooncake":
        print(f"metrics           {server.metrics_url}")
        print(f"storage           {server.storage_processes} x {server.segment_size} bytes")
        print(f"logs              {server.log_dir}")
    print(f"backend options   {json.dumps(server.options)}")
    print(f'config:\n  backend = "{store}"\n  [options]')
    for key, value in server.options.items():
        print(f"  {key} = {json.dumps(value)}")
    for key, value in getattr(server, "env", {}).items():
        print(f"export {key}={shlex.quote(value)}")
    print("Ctrl-C to stop.", flush=True)
