"""Run a local store for development: loopback only, free ports, Ctrl-C stops it.

``kvconn dev-server redis`` starts one redis-server (or a Redis Cluster with
``--cluster N``); ``kvconn dev-server mooncake`` starts a Mooncake master and standalone
storage processes, so data outlives short-lived clients. Each prints the backend options
to put in a kvconn configuration.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from kvconn.tools.devserver import mooncake
from kvconn.tools.devserver.redis import RedisCluster, RedisServer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="store", metavar="STORE", required=True)
    redis = sub.add_parser(
        "redis",
        help="one redis-server, or a Redis Cluster",
        description="Start redis-server on 127.0.0.1 with persistence off.",
    )
    redis.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    redis.add_argument("--maxmemory", default=None, help="e.g. 1gb: evict beyond this")
    redis.add_argument(
        "--maxmemory-policy", default=None, help="e.g. allkeys-lru (with --maxmemory)"
    )
    redis.add_argument(
        "--cluster", type=int, default=0, metavar="N", help="start an N-node Redis Cluster"
    )
    redis.add_argument("--json", action="store_true", help="print the options as one JSON line")
    redis.set_defaults(_store_run=_run_redis)
    moon = sub.add_parser(
        "mooncake",
        help="a Mooncake master and storage processes",
        description=(mooncake.__doc__ or "").strip().split("\n\n")[0],
    )
    mooncake.add_arguments(moon)
    moon.set_defaults(_store_run=mooncake.run)


def run(args: argparse.Namespace) -> int:
    return int(args._store_run(args))


def _run_redis(args: argparse.Namespace) -> int:
    problem = RedisServer.available()
    if problem is not None:
        print(f"redis dev server unavailable: {problem}", file=sys.stderr)
        return 1
    server: RedisServer | RedisCluster
    if args.cluster:
        server = RedisCluster(
            args.cluster, maxmemory=args.maxmemory, maxmemory_policy=args.maxmemory_policy
        )
    else:
        server = RedisServer(
            args.port, maxmemory=args.maxmemory, maxmemory_policy=args.maxmemory_policy
        )
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with server:
            if args.json:
                print(json.dumps(server.options), flush=True)
            else:
                print(f"backend options  {json.dumps(server.options)}")
                print('config:\n  backend = "redis"\n  [options]')
                for key, value in server.options.items():
                    print(f"  {key} = {json.dumps(value)}")
                print("Ctrl-C to stop.", flush=True)
            stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
