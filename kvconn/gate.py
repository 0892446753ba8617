"""The gate a load's bytes pass on their way into the engine's slots.

An engine may give up on a load while it is still being read (its deadline passed, the
request was aborted) and reuse the slots at once. From then on, not one more byte of
that load may reach them. Every asynchronous load (``kvconn.transfer``, agreed striped
loads in ``kvconn.rounds``) therefore scatters each piece of work under a gate: held
while the bytes are written, shut by the give-up, and counting the blocks that passed,
which are the load's result when it is given up.

Torch-free.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

#: Entered with a piece's block count just before its bytes are scattered into slots;
#: yields whether they may be (a cancelled asynchronous load writes nothing more).
#: Entered with 0 blocks, it only asks whether the load is still wanted.
Gate = Callable[[int], contextlib.AbstractContextManager[bool]]


class ScatterGate:
    """A :data:`Gate` that can be shut, counting the blocks that passed it.

    ``lock`` may be the owner's: a transfer shuts its gate and records its result as one
    step under its own lock, so a load is given up exactly once.
    """

    def __init__(self, lock: threading.Lock | None = None) -> None:
        self.lock = lock if lock is not None else threading.Lock()
        self.passed = 0  # blocks written into slots so far
        self.shut = False  # given up: nothing more reaches the slots

    @contextlib.contextmanager
    def __call__(self, blocks: int) -> Iterator[bool]:
        with self.lock:
            allowed = not self.shut
            yield allowed
            if allowed:
                self.passed += blocks

    def close(self) -> int:
        """Shut the gate (the caller holds :attr:`lock`); the blocks that passed it.

        Scatters run under the lock, so once this returns none is under way."""
        self.shut = True
        return self.passed
