"""Mooncake Store backend: the primary high-performance store, zero-copy where it can be.

Pages are Mooncake objects (``mooncake.store.MooncakeDistributedStore``), moved with the
zero-copy batch calls. Options, configuration through ``MOONCAKE_CONFIG_PATH`` /
``MOONCAKE_*``, the storage process data needs, and logging: ``docs/backends.md``.
Return codes and fault behaviour, as measured: ``docs/notes/mooncake-api.md``.

One concern per module, each importing only those listed after it (a test parses the
imports and keeps it so), so data flows one way and nothing calls back into its caller:

* :mod:`._transfer` - exists / put / get / delete over the zero-copy calls; runs what
  the fail-over policy decides for keys that failed;
* :mod:`._session` - the client's set-up behind a master probe, calls in flight, close;
* :mod:`._failover` - the fail-over policy: for a read or put that failed on a dead
  storage process, another copy, a final status, or live segments to put to;
* :mod:`._memory` - registered memory, the scratch area, rounds of a batch;
* :mod:`._replicas` - where a key's copies lie; reading one from a chosen copy through
  the shared transfer engine, and the endpoints that failed lately;
* :mod:`._config` - the options, merged with Mooncake's own settings, checked;
* :mod:`._flight` - calls that move bytes cut into slices, so that no more keys move at
  once than Mooncake's TCP transport queues;
* :mod:`._library` - loading Mooncake's library with its INFO logging off;
* :mod:`._counters`, :mod:`._codes` - the counters; Mooncake's result codes sorted into
  miss, failure and outage.

(:mod:`._memory` reads the session's state through its ``Client`` protocol: the one
place a lower module still asks its owner something.)

Threads: one backend may be called from several threads at once
(``Capabilities.thread_safe``): the client allows it and releases the GIL while it works;
what the backend keeps besides (registered ranges, scratch areas, counters, the live
segments and failed endpoints of fail-over) changes under locks never held across a
call to the client; see :mod:`._session` and :mod:`._memory`.

No listing: the client has no API to enumerate keys (only ``remove_by_regex``).
``MooncakeBackend.counters`` counts what each path did (``put_zero_copy``,
``put_scratch``, ``put_full``, ``put_rerouted``, ``get_zero_copy``, ``get_wrong_size``,
``get_failover``, ``get_failed`` …).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import ClassVar

from kvconn.backend import Backend, Capabilities, ReadStatus, as_bytes_view
from kvconn.errors import BackendDependencyMissing
from kvconn_mooncake import _library
from kvconn_mooncake._config import MooncakeConfig, make_config
from kvconn_mooncake._counters import Counters
from kvconn_mooncake._session import Session
from kvconn_mooncake._transfer import Transfers

__all__ = ["MooncakeBackend", "MooncakeConfig"]


class MooncakeBackend(Backend):
    """Batched exists / put / get over one Mooncake client (options: docs/backends.md)."""

    name: ClassVar[str] = "mooncake"
    extra: ClassVar[str | None] = "mooncake"
    client_modules: ClassVar[tuple[str, ...]] = ("mooncake.store",)
    capabilities: ClassVar[Capabilities] = Capabilities(
        buffer_registration=True, delete=True, thread_safe=True, io_threads=True
    )

    def __init__(
        self,
        master_address: str | None = None,
        *,
        metadata_server: str | None = None,
        protocol: str | None = None,
        device_name: str | Sequence[str] | None = None,
        local_hostname: str | None = None,
        global_segment_size: int | str | None = None,
        local_buffer_size: int | str | None = None,
        replica_num: int = 1,
        soft_pin: bool = False,
        setup_retries: int | None = None,
        probe_timeout_s: float = 0.5,
        scratch_bytes: int | str = 64 * 2**20,
        read_env: bool = True,
        read_failover: bool = True,
        transfers_in_flight: int | None = None,
    ) -> None:
        """Check the options, then set the client up (see :meth:`Session.start`)."""
        options = dict(locals())  # every argument by name: nothing else is bound yet
        del options["self"]
        try:
            mooncake_store = _library.load("store")
        except (ImportError, OSError) as exc:
            raise BackendDependencyMissing(
                self.name, self.client_modules[0], self.extra or self.name
            ) from exc
        self.config: MooncakeConfig = make_config(options)
        #: What each path did, per key or call: lets tests and operators see that the
        #: zero-copy path is taken and why saves were dropped or loads failed.
        self.counters = Counters()
        self._session = Session(mooncake_store, self.config, self.counters)
        self._transfers = Transfers(self._session, self.counters)
        self._session.start()

    def __repr__(self) -> str:
        return f"MooncakeBackend({self.config.master_address!r}, {self.config.protocol})"

    @property
    def where(self) -> str:
        return self.config.master_address

    @classmethod
    def client_problem(cls) -> str | None:
        with contextlib.suppress(ImportError, OSError):  # super() names the problem
            _library.load("store")  # as the backend would: quietly
        problem = super().client_problem()
        if problem is not None and "ibverbs" in problem:
            problem += "; Mooncake links libibverbs even for TCP: apt-get install libibverbs1"
        return problem

    def close(self) -> None:
        """Unregister memory and close the client (~1 s in Mooncake); idempotent.

        Waits for calls in progress; any call afterwards raises :class:`BackendError`.
        """
        self._session.close()

    def register_buffer(self, buffer: memoryview) -> None:
        """Register ``buffer`` once; puts and gets inside it then skip every copy.

        Never raises for a store problem (the connector calls this outside its error
        handling): if Mooncake refuses, the range is simply not used for zero-copy, and
        if the client is not set up yet, registration happens at setup.
        """
        view = as_bytes_view(buffer, "registered buffer")
        if view.readonly:
            raise ValueError("a registered buffer must be writable (gets land in it)")
        if view.nbytes == 0:
            return
        self._session.check_open()
        self._session.memory.add(view)

    def unregister_buffer(self, buffer: memoryview) -> None:
        view = as_bytes_view(buffer, "registered buffer")
        if not view.readonly and view.nbytes:
            self._session.memory.remove(view)

    def _exists(self, keys: list[str]) -> Sequence[bool]:
        return self._transfers.exists(keys)

    def _put(self, keys: list[str], values: list[memoryview]) -> Sequence[bool]:
        return self._transfers.put(keys, values)

    def _get(self, keys: list[str], buffers: list[memoryview], *, scratch: bool) -> Sequence[bool]:
        loaded = ReadStatus.LOADED
        return [s is loaded for s in self._read_status(keys, buffers, scratch=scratch)]

    def _read_status(
        self, keys: list[str], buffers: list[memoryview], *, scratch: bool
    ) -> Sequence[ReadStatus]:
        """Why each key did not load, as the transfer learned it (:mod:`._transfer`):
        ``MISSING``, ``WRONG_SIZE``, or ``UNREACHABLE`` for a key no copy of which could
        be fetched (its storage process died; the master still lists it)."""
        if scratch:
            return self._transfers.read_scratch(keys, buffers)
        return self._transfers.read(keys, buffers)

    def _delete(self, keys: list[str]) -> Sequence[bool]:
        return self._transfers.delete(keys)
