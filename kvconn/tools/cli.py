"""The ``kvconn`` command line.

Subcommands live in their own modules, each exposing ``add_arguments(parser)`` and
``run(args) -> int``; this module only wires them up, so ``kvconn --help`` stays fast
and a broken optional subcommand cannot break ``kvconn backends``.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import sys
from collections.abc import Sequence

from kvconn import __version__
from kvconn.errors import KvconnError
from kvconn.redaction import redact_url

#: name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "backends": ("kvconn.tools.cli", "list installed storage backends and whether they can load"),
    "simulate": (
        "kvconn.tools.simulate",
        "run a TP serving workload with a real model layout, verify every load, report footprint",
    ),
    "inspect": ("kvconn.tools.inspect_store", "report a store's footprint by model and role"),
    "dev-server": (
        "kvconn.tools.devserver.cli",
        "run a local Redis or Mooncake server for development",
    ),
}

DESCRIPTION = """\
kvconn: a KV-cache connector core that stores bytes identical across tensor-parallel
ranks (MLA latents, indexer keys, GQA-duplicated heads) once instead of once per rank,
over any exists/put/get store (lmdb, redis, mooncake, or a third-party backend).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON array")


def run(args: argparse.Namespace) -> int:
    from kvconn.registry import describe_backends

    infos = describe_backends()
    if args.json:
        print(json.dumps([info.__dict__ for info in infos], indent=2))
        return 0
    if not infos:
        print("no kvconn backends are installed (entry-point group 'kvconn.backends')")
        return 1
    width = max(len(i.name) for i in infos)
    dist_width = max(len(i.distribution) for i in infos)
    for info in infos:
        status = "ok" if info.problem is None else f"unavailable: {info.problem}"
        print(f"{info.name:<{width}}  {info.distribution:<{dist_width}}  {status}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvconn",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvconn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = (
                sys.modules[__name__]
                if module_name == __name__
                else importlib.import_module(module_name)
            )
        except ImportError:
            continue  # an optional subcommand whose module is absent
        sp = sub.add_parser(
            name,
            help=help_text,
            description=(module.__doc__ or help_text).strip().split("\n\n")[0],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sp)
        sp.set_defaults(_run=module.run)
    return parser


def _tolerant_output() -> None:
    """Print what the terminal cannot encode as escapes instead of dying on it.

    Reports quote names from the store (a model, a key prefix, keys other programs
    wrote) that may be non-ASCII or not even UTF-8; an ASCII terminal must still get
    its report.
    """
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")


def main(argv: Sequence[str] | None = None) -> int:
    _tolerant_output()
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args))
    except KvconnError as exc:
        # Masked again here: a message may quote a URL with a password in it.
        print(f"kvconn {args.command}: error: {redact_url(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
