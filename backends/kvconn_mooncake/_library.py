"""Loading Mooncake's native library quietly, and setting its environment for a call.

Mooncake's C++ code logs through glog to stderr, about twenty ``I…`` lines for every
client set up (topology discovery, metrics, ports, memory registered): noise in a
serving engine that builds one backend per rank. Measured with 0.3.13.post1:

* the level comes from ``MC_LOG_LEVEL`` alone (``TRACE``, ``INFO``, ``WARNING``,
  ``ERROR``, in capitals; anything else means ``INFO``). glog's own
  ``GLOG_minloglevel`` is overridden by it and has no effect;
* it is read once, when a library (``mooncake/store.so``, ``mooncake/engine.so``) is
  loaded, and every load sets it again for the whole process (glog is shared): an
  engine loaded later without the variable brings the INFO lines back.

So every import of a Mooncake module here runs with ``MC_LOG_LEVEL=WARNING`` unless
the user set the variable (a non-empty value wins, ``INFO`` brings the lines back);
the environment is restored afterwards, so processes started later (a
``mooncake_master``, a ``mooncake_client``) keep their own defaults. A process that
imported ``mooncake.store`` itself before kvconn did logs at whatever level that import
had.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from types import ModuleType

log = logging.getLogger(__name__)

LOG_LEVEL_ENV = "MC_LOG_LEVEL"
#: Warnings and errors stay: a refused registration or a missing RDMA device matters.
DEFAULT_LOG_LEVEL = "WARNING"
LOG_LEVELS = ("TRACE", "INFO", "WARNING", "ERROR")

#: Mooncake reads its settings from the process environment, which is shared by every
#: thread; changes to it are serialised here.
_ENV_LOCK = threading.Lock()
_warned: list[str] = []


@contextlib.contextmanager
def environment(name: str, value: str | None) -> Iterator[None]:
    """Set (or, with None, leave as is) one environment variable for a block."""
    with _ENV_LOCK:
        if value is None:
            yield
            return
        previous = os.environ.get(name)
        os.environ[name] = value
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = previous


def load(module: str) -> ModuleType:
    """Import ``mooncake.<module>`` with Mooncake's INFO logging off unless asked for.

    Raises what the import raises (``ImportError``, or ``OSError`` for a missing
    ``libibverbs``); callers turn that into their own message.
    """
    name = f"mooncake.{module}"
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    chosen = os.environ.get(LOG_LEVEL_ENV, "")
    if chosen and chosen not in LOG_LEVELS and not _warned:
        _warned.append(chosen)  # once: each library load would say it again
        log.warning(
            "kvconn: %s=%r is not a level Mooncake knows (%s, in capitals); it logs at INFO",
            LOG_LEVEL_ENV,
            chosen,
            ", ".join(LOG_LEVELS),
        )
    with environment(LOG_LEVEL_ENV, None if chosen else DEFAULT_LOG_LEVEL):
        return importlib.import_module(name)
