"""Loading Mooncake's native library, and setting its environment for a call.

Mooncake reads settings from the process environment (``MC_*``), some when a library
loads and some when a client is set up; :func:`environment` changes one for a block,
serialised, and restores it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Iterator
from types import ModuleType

#: Mooncake reads its settings from the process environment, which is shared by every
#: thread; changes to it are serialised here.
_ENV_LOCK = threading.Lock()


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
    """Import ``mooncake.<module>``.

    Raises what the import raises (``ImportError``, or ``OSError`` for a missing
    ``libibverbs``); callers turn that into their own message.
    """
    return importlib.import_module(f"mooncake.{module}")
