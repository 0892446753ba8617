"""Where kvconn's transfer threads run: the ``transfer_cpus`` setting, read once.

An engine adapter may know cores its engine keeps free for KV transfers (vLLM's CPU
backend keeps one per rank) and suggest them; that is ``"auto"``, the default. But the
best place depends on what else shares the host: a store server on the kept core (Redis
at TP=1 on a small machine) takes turns with the reads it serves. So a deployment can
say ``"inherit"`` (the threads stay where the thread that starts them runs, in a
binding engine the step's own cores) or name the CPUs outright (``"6-7"``), in every
engine alike.

The transfer threads are not the only ones that move bytes: a backend's client may start
threads of its own as it connects (Mooncake's transfer engine starts some thirty), and a
new thread runs where the thread that started it runs. :func:`connecting_on` opens the
connection from the transfer CPUs, so those threads leave the forward pass's core too.

Torch-free: the configuration validates with the pure functions here.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Collection, Iterator

from kvconn.errors import ConfigError

__all__ = [
    "AUTO",
    "INHERIT",
    "MAX_CPU",
    "check_setting",
    "connecting_on",
    "parse_cpu_list",
    "placement",
]

log = logging.getLogger(__name__)

#: The engine adapter's suggestion, if it has one; else where the threads start.
AUTO = "auto"
#: Where the threads start: the affinity of the thread that starts them.
INHERIT = "inherit"
#: A CPU number beyond any machine's: a typo (``"0-99999999"`` would build a huge set).
MAX_CPU = (1 << 16) - 1


def parse_cpu_list(text: str, what: str) -> set[int]:
    """The CPUs of a Linux CPU list (``"0-3,8"``, as ``taskset -c`` and sysfs write them).

    ``what`` names where the text came from, for the error: a ``ValueError``.
    """
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, sep, high = part.partition("-")
        if not (low.strip().isdigit() and (not sep or high.strip().isdigit())):
            raise ValueError(f"{what}: {part!r} is not a CPU number or range")
        first = int(low)
        last = int(high) if sep else first
        if last < first:
            raise ValueError(f"{what}: the range {part!r} runs backwards")
        if last > MAX_CPU:
            raise ValueError(f"{what}: CPU {last} is beyond any machine's (at most {MAX_CPU})")
        cpus.update(range(first, last + 1))
    return cpus


def check_setting(value: object) -> str:
    """``transfer_cpus`` as written: ``"auto"``, ``"inherit"`` or a non-empty CPU list.

    An int is taken as one CPU (a TOML ``transfer_cpus = 3``). Returns the text to keep.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise ConfigError(
            f"transfer_cpus must be 'auto', 'inherit' or a CPU list like '6-7', got {value!r}"
        )
    text = value.strip()
    if text in (AUTO, INHERIT):
        return text
    try:
        cpus = parse_cpu_list(text, "transfer_cpus")
    except ValueError as exc:
        raise ConfigError(f"{exc} (give 'auto', 'inherit' or a CPU list like '6-7')") from None
    if not cpus:
        raise ConfigError("transfer_cpus names no CPU (give 'auto', 'inherit' or a CPU list)")
    return text


def placement(
    setting: str, suggested: Collection[int] | None, online: int | None
) -> frozenset[int] | None:
    """The CPUs the transfer threads run on, or None to leave them where they start.

    ``setting``: a value :func:`check_setting` kept. ``suggested``: the engine adapter's
    choice for ``"auto"`` (None: it has none). ``online``: the machine's CPU count
    (``os.cpu_count()``), against which a named CPU that does not exist is a
    ``ConfigError`` at start-up rather than a warning once the threads start.
    """
    if setting == AUTO:
        return None if suggested is None else frozenset(suggested)
    if setting == INHERIT:
        return None
    cpus = frozenset(parse_cpu_list(setting, "transfer_cpus"))
    if online is not None and max(cpus) >= online:
        raise ConfigError(
            f"transfer_cpus names CPU {max(cpus)}, but this machine has CPUs 0-{online - 1}"
        )
    return cpus


@contextlib.contextmanager
def connecting_on(setting: str, suggested: Collection[int] | None = None) -> Iterator[None]:
    """Run the body (an engine adapter building its ``Connector``) on the transfer CPUs,
    then put the calling thread back where it was.

    Threads a backend's client starts while it connects inherit the CPUs of the thread
    that connects. In an engine that binds its compute threads, that is the forward
    pass's core, where the client's I/O threads would take turns with the model; made
    here, they run where kvconn's transfer threads run (:func:`placement` of ``setting``
    and ``suggested``, as :class:`kvconn.transfer.TransferService` takes them). No
    placement, or a set the system refuses (logged): the body runs where it is.

    The adapters open it with the setting alone, so only a CPU list the user names moves
    the client: on the one core vLLM keeps, Mooncake's I/O threads beside kvconn's
    transfer threads made its loads slower (``docs/performance.md``, 2026-12-06).

    Memory the client first touches while connecting (Mooncake's segment) lands on
    those CPUs' NUMA node by the kernel's first-touch rule: the reason a hand-written
    CPU list should name the rank's own node.
    """
    cpus = placement(setting, suggested, os.cpu_count())
    before: set[int] | None = None
    if cpus is not None:
        try:
            before = os.sched_getaffinity(0)  # 0: this thread alone, on Linux
            os.sched_setaffinity(0, cpus)
        except (AttributeError, OSError, ValueError) as exc:
            log.warning("kvconn: cannot connect from CPUs %s (%s)", sorted(cpus), exc)
            before = None
    try:
        yield
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)
