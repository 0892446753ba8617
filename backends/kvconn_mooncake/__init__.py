"""Mooncake Store backend: the primary high-performance store, zero-copy where it can be.

Pages are Mooncake objects (``mooncake.store.MooncakeDistributedStore``). Bytes move with
the zero-copy batch calls, ``batch_put_from`` and ``batch_get_into``: the transfer engine
reads from and writes to the caller's memory directly. The connector registers its
staging buffer once (:meth:`MooncakeBackend.register_buffer`); a value or buffer inside a
registered range goes straight to the store, anything else is copied through one
registered scratch area owned by the backend (see :mod:`kvconn_mooncake._memory`).
Mooncake's copying API (``put`` / ``get``) is never used: it cannot tell a miss from an
error, answers a batch put with one code, and is capped by ``local_buffer_size``.

How the contract maps onto Mooncake (measured, ``docs/notes/mooncake-api.md``):

* ``exists`` is one ``batch_is_exist``; any negative code raises (never a miss).
* ``put`` de-duplicates the batch first (Mooncake stores the *second* of two equal
  keys; the contract wants the first). Mooncake never overwrites: a put of a stored key,
  or of one another writer has in flight, returns 0 → True. ``-200`` (no space) is a
  dropped save → False, not an exception.
* ``get`` must not touch a buffer whose size differs from the stored value's, but
  ``batch_get_into`` writes a shorter value into a larger buffer before anyone can
  compare. So each get first asks the master for the stored sizes
  (``batch_get_replica_desc``, one RPC for the batch, ~0.3-0.9 ms for 64 keys, ~2 % of a
  64 x 1 MiB transfer) and reads only the keys whose size matches. That query also takes
  Mooncake's read lease (``default_kv_lease_ttl``, 10 s), so the object cannot be evicted
  or removed (short of ``remove(force=True)``) between the size check and the read. Only
  ``COMPLETE`` replicas count, so a put still in flight reads as a miss, never torn.
  Duplicate keys are read once and copied: ``batch_get_into`` with a key twice reports
  success for both but fills only one buffer.
* ``get(..., scratch=True)`` (the connector's reads, into staging) skips that query:
  a failed key may leave bytes in a scratch buffer, and a wrong size is still told
  apart (``-600`` for a buffer too small, nothing written; the value's length when the
  buffer is larger). ``batch_get_into`` takes the read lease itself. Copies are only
  described for keys whose transfer failed, to read them from another replica.
* ``-900`` (master unreachable) raises :class:`BackendUnavailable`. Against a dead master
  Mooncake blocks each call ~4.4 s and no timeout knob shortens it, so after one such
  failure the backend first tries a TCP connection to the master (``probe_timeout_s``)
  and raises at once while that is refused: a dead master costs at most one slow call,
  not one per request. A master that accepts connections but does not answer still
  costs ~4.4 s per call (the connector's ``retry_interval_s`` back-off bounds how
  often). After a master restart the client's first call fails once with ``-900``; when
  the probe then connects, the call is repeated once, so a restart drops nothing. The
  restarted master has lost every object (its metadata lives only there).
* Memory: unregistering while the metadata server is down fails yet leaves the range
  registered for good, wedging every later registration that overlaps it (freed memory
  is soon reused). Unregistration is therefore deferred until the metadata server
  answers (checked by a TCP probe), and refused registrations are retried every few
  seconds; meanwhile that memory moves through the scratch area.
* A dead storage process: until the master drops its segment (``client_ttl``, default
  10 s), ``exists`` still reports its objects and the client keeps reading them from the
  dead copy (``-800`` after a ~0.5 s connect timeout), even when another replica
  (``replica_num`` ≥ 2) is alive. So the backend shares a transfer engine with the client
  and, for such keys, reads the live copy itself at the address the replica query returned
  (:mod:`kvconn_mooncake._failover`); the failed endpoint is then bypassed for 30 s, so
  later reads do not pay the timeout again. Keys whose only copy is gone read False: a
  failed load that the engine recomputes. Puts the master places on the dead segment
  fail the same way (the key stays absent); they are put once more, preferring the
  segments that took the batch's other keys.
* Calling the client before ``setup()`` succeeded or after ``close()`` crashes the
  process (SIGSEGV), so every call checks the backend's state first: after
  :meth:`close` it raises :class:`BackendError`; while the master was unreachable at
  start it retries ``setup()`` (behind the same probe) and raises until that works.

No listing: the client has no API to enumerate keys (only ``remove_by_regex``).
``MooncakeBackend.counters`` counts what each path did (``put_zero_copy``,
``put_scratch``, ``put_full``, ``put_rerouted``, ``get_zero_copy``, ``get_wrong_size``,
``get_failover``, ``get_failed`` …).

Options (keyword arguments; ``load_backend("mooncake", {...})``). Those marked * may
instead come from Mooncake's own configuration: the JSON file at ``MOONCAKE_CONFIG_PATH``
(or ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``; keys in parentheses), else the environment
variables named; an explicit option always wins.

``master_address`` * (``master_server_address``, ``MOONCAKE_MASTER``)
    The master's RPC ``host:port``, or an ``etcd://`` address for a master with HA.
``metadata_server`` * (``metadata_server``, ``MOONCAKE_TE_META_DATA_SERVER``)
    Transfer-engine metadata: ``http://host:port/metadata``, ``etcd://…``, or
    ``P2PHANDSHAKE`` (default).
``protocol`` * (``protocol``, ``MOONCAKE_PROTOCOL``)
    ``tcp`` (default) or ``rdma``.
``device_name`` * (``device_name``, ``MOONCAKE_DEVICE``)
    RDMA device(s): ``"mlx5_0"``, ``"mlx5_0,mlx5_1"`` or a list; ``""`` = auto.
``local_hostname`` * (``local_hostname``, ``MOONCAKE_LOCAL_HOSTNAME``)
    The address this client advertises to the transfer engine (default ``localhost``).
``global_segment_size`` * (``global_segment_size``, ``MOONCAKE_GLOBAL_SEGMENT_SIZE``)
    Memory this process contributes to the store, bytes or ``"4gb"``. Default 0: a pure
    client, data lives in standalone storage processes (``mooncake_client``) and
    survives engine restarts. With > 0 the pages this process stores vanish when it
    closes. A vLLM file with ``"mode": "standalone-store"`` means 0 too.
``local_buffer_size`` * (``local_buffer_size``, ``MOONCAKE_LOCAL_BUFFER_SIZE``)
    Staging of Mooncake's copying API, unused by kvconn (default 16 MiB).
``replica_num``
    Copies of each page on distinct storage processes (default 1; best effort).
``soft_pin``
    Store pages soft-pinned (``soft_pin_action=ENABLE``): evicted only after unpinned
    objects. Default False.
``setup_retries``
    ``setup()`` attempts (Mooncake's ``MC_STORE_CLIENT_SETUP_RETRIES``, ~4.4 s each
    against an unresponsive master; Mooncake's default is 20). Default: that variable if
    set, else 3 — the TCP probe already covers a master that is simply not up.
``probe_timeout_s``
    Timeout of the TCP probe of the master after a failure (default 0.5).
``scratch_bytes``
    Most bytes copied through the scratch area per round for unregistered buffers
    (default 64 MiB; a larger single value gets room of its own size).
``read_env``
    Read ``MOONCAKE_CONFIG_PATH`` / ``MOONCAKE_*`` (default True).
``read_failover``
    Read from a live replica when the client's chosen one fails (default True). Needs
    the client set up with a transfer engine kvconn starts (``mooncake.engine``); if
    that cannot start, a warning says so and reads go through the client alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

from kvconn.backend import Backend, Capabilities, as_bytes_view
from kvconn.errors import BackendDependencyMissing, BackendError, BackendUnavailable, ConfigError
from kvconn_mooncake import _codes as codes
from kvconn_mooncake._config import MooncakeConfig, make_config
from kvconn_mooncake._failover import AVOID_S, Copy, Read, ReplicaReader, Stored, make_engine
from kvconn_mooncake._memory import Registry, Scratch, address_of

__all__ = ["MooncakeBackend", "MooncakeConfig"]

log = logging.getLogger(__name__)

_SETUP_RETRIES_ENV = "MC_STORE_CLIENT_SETUP_RETRIES"
_MEMORY_RETRY_INTERVAL_S = 5.0
_DEFAULT_SETUP_RETRIES = 3
_ENV_LOCK = threading.Lock()  # setup() reads the retry count from the environment


class MooncakeBackend(Backend):
    name: ClassVar[str] = "mooncake"
    extra: ClassVar[str | None] = "mooncake"
    client_modules: ClassVar[tuple[str, ...]] = ("mooncake.store",)
    capabilities: ClassVar[Capabilities] = Capabilities(buffer_registration=True, delete=True)

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
    ) -> None:
        """Check the options, then set the client up.

        A master that refuses connections is not an error here — it may come up later,
        and until it does every call raises :class:`BackendUnavailable`, which the
        connector serves as misses. A master that accepts connections while ``setup()``
        still fails (wrong metadata server, protocol or device) is a
        :class:`ConfigError`: retrying would not fix it.
        """
        try:
            from mooncake import store as mooncake_store
        except (ImportError, OSError) as exc:
            raise BackendDependencyMissing(
                self.name, self.client_modules[0], self.extra or self.name
            ) from exc
        self._mc: Any = mooncake_store
        self.config: MooncakeConfig = make_config(
            {
                "master_address": master_address,
                "metadata_server": metadata_server,
                "protocol": protocol,
                "device_name": device_name,
                "local_hostname": local_hostname,
                "global_segment_size": global_segment_size,
                "local_buffer_size": local_buffer_size,
            },
            replica_num=replica_num,
            soft_pin=soft_pin,
            setup_retries=setup_retries,
            probe_timeout_s=probe_timeout_s,
            scratch_bytes=scratch_bytes,
            read_env=read_env,
            read_failover=read_failover,
        )
        self._replicate = self._replicate_config()
        #: What each path did, per key or call: lets tests and operators see that the
        #: zero-copy path is taken and why saves were dropped or loads failed.
        self.counters: Counter[str] = Counter()
        self._state = threading.Lock()  # guards _active / _closed; _cond waits on it
        self._cond = threading.Condition(self._state)
        self._active = 0
        self._closed = False
        self._store: Any = None
        #: Reads from explicit replicas through the client's transfer engine (None: off).
        self._reader: ReplicaReader | None = None
        self._down = False
        self._setup_lock = threading.Lock()
        self._memory_lock = threading.RLock()
        self._registry = Registry()
        #: Ranges to unregister once the metadata server answers (start -> end), see
        #: :meth:`_unregister_raw`.
        self._stale: dict[int, int] = {}
        self._memory_retry_at = 0.0
        #: Segments puts landed on lately, and until when to trust that; see _live_segments.
        self._live: tuple[list[str], float] = ([], 0.0)
        self._scratch = Scratch(self._register_raw, self._unregister_raw)
        try:
            self._connect(at_start=True)
        except BackendUnavailable as exc:
            log.warning("kvconn: %s; calls will fail until it answers", exc)

    def __repr__(self) -> str:
        return f"MooncakeBackend({self.config.master_address!r}, {self.config.protocol})"

    @property
    def where(self) -> str:
        return self.config.master_address

    @classmethod
    def client_problem(cls) -> str | None:
        problem = super().client_problem()
        if problem is not None and "ibverbs" in problem:
            problem += "; Mooncake links libibverbs even for TCP: apt-get install libibverbs1"
        return problem

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Unregister memory and close the client (~1 s in Mooncake); idempotent.

        Waits for calls in progress: closing under a running call would crash the
        process, as would any call afterwards, which raises :class:`BackendError` instead.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            while self._active:
                self._cond.wait()
        with self._memory_lock:  # close() drops every registration of the client at once
            self._scratch.release()
            for entry in self._registry.entries():
                self._registry.remove(entry.start)
            self._stale.clear()
        store, self._store = self._store, None
        if store is not None:
            with contextlib.suppress(Exception):
                store.close()
        self._reader = None  # the engine goes after the client that shares it

    def _connect(self, *, at_start: bool) -> None:
        """``setup()`` a new client, behind a TCP probe of the master; register memory."""
        self._probe()
        store = self._mc.MooncakeDistributedStore()
        retries = self.config.setup_retries
        if retries is None:
            text = os.environ.get(_SETUP_RETRIES_ENV, str(_DEFAULT_SETUP_RETRIES))
            if not text.strip().isdigit() or int(text) < 1:
                raise ConfigError(
                    f"mooncake: environment variable {_SETUP_RETRIES_ENV} must be an int >= 1, "
                    f"got {text!r}"
                )
            retries = int(text)
        shared = self._engine() if self.config.read_failover else None
        with _ENV_LOCK, _environment(_SETUP_RETRIES_ENV, str(retries)):
            args = self.config.setup_args()
            try:
                if shared is not None:
                    engine, name = shared
                    code = store.setup(name, *args[1:], engine.get_engine())
                else:
                    code = store.setup(*args)
            except Exception as exc:  # a pybind11 argument error: the options are wrong
                raise ConfigError(f"mooncake: setup() rejected the options: {exc}") from exc
        if code != 0:
            with contextlib.suppress(Exception):
                store.close()
            message = (
                f"mooncake: setup() against master {self.config.master_address} failed "
                f"({codes.describe(code)}); check metadata_server "
                f"({self.config.metadata_server!r}), protocol ({self.config.protocol!r}) and "
                f"device_name ({self.config.device_name!r})"
            )
            if at_start:
                raise ConfigError(message)
            raise BackendUnavailable(message)
        with self._memory_lock:
            for entry in self._registry.entries():
                self._registry.mark(
                    entry, self._register_with(store, entry.start, entry.end - entry.start)
                )
        self._store = store
        self._reader = ReplicaReader(shared[0]) if shared is not None else None
        self._down = False

    def _engine(self) -> tuple[Any, str] | None:
        """A transfer engine for the client to share, so reads can pick their replica."""
        try:
            from mooncake import engine as mooncake_engine
        except (ImportError, OSError) as exc:
            log.warning("kvconn: mooncake replica fail-over is off: %r", exc)
            return None
        config = self.config
        return make_engine(
            mooncake_engine,
            config.local_hostname,
            config.metadata_server,
            config.protocol,
            config.device_name,
        )

    def _probe(self) -> None:
        """Fail fast when the master's port refuses connections (see the module doc)."""
        target = self.config.master_host_port
        if target is None:
            return
        problem = _tcp_problem(target, self.config.probe_timeout_s)
        if problem is not None:
            self.counters["refused_master_down"] += 1
            raise BackendUnavailable(
                f"mooncake master at {self.config.master_address} is unreachable ({problem})"
            )

    def _metadata_reachable(self) -> bool:
        """Whether the transfer-engine metadata server accepts connections (or is none).

        Registering and unregistering memory publish the client's segment there; see
        :meth:`_unregister_raw` for why that must not be tried while it is down.
        """
        target = self.config.metadata_host_port
        return target is None or _tcp_problem(target, self.config.probe_timeout_s) is None

    def _enter(self) -> Any:
        """The set-up client, for one call; never once closed (that would crash).

        Every successful ``_enter`` is paired with :meth:`_leave` (``try/finally``), so
        :meth:`close` can wait for calls in flight. Plain methods rather than a context
        manager: this runs on every call, and ``exists`` is only ~0.1 ms of RPC.
        """
        with self._state:  # the lock itself: Condition.__enter__ is a Python-level call
            if self._closed:
                raise BackendError(f"mooncake at {self.where}: the backend is closed")
            self._active += 1
        store = self._store
        if store is not None and not (self._down or self._stale or self._registry.any_failed):
            return store  # the common case: one test of four plain attributes
        try:
            if self._store is None:
                with self._setup_lock:
                    if self._store is None:
                        self._connect(at_start=False)
            elif self._down:
                self._probe()
            if (self._stale or self._registry.any_failed) and not self._down:
                self._mend_registrations(self._store)
        except BaseException:
            self._leave()
            raise
        return self._store

    def _leave(self) -> None:
        with self._state:
            self._active -= 1
            if self._closed and not self._active:  # only close() ever waits
                self._cond.notify_all()

    def _codes(self, op: str, fn: Any, *args: Any) -> list[int]:
        """Call a client method that answers per-key codes; raise for store failures."""
        results: list[int] = self._invoke(op, fn, *args)
        if not results or min(results) >= 0:  # the common case, checked at C speed
            self._down = False
            return results
        return self._recover(op, fn, args, results)

    def _exist_codes(self, store: Any, keys: list[str]) -> Sequence[int]:
        """``batch_is_exist``'s 1/0 per key; raises rather than answer a failure as absent.

        The check runs on every lookup and costs more than it seems: ``min()`` and
        ``map(bool)`` over 64 codes are ~3 µs here against ~90 µs for the RPC itself.
        ``bytes()`` refuses negative codes at C speed, and the packed flags are what
        :func:`kvconn.backend.as_bools` converts fastest.
        """
        n = len(keys)
        results: list[int] = self._invoke("exists", store.batch_is_exist, keys)
        try:
            flags = bytes(results)
        except (ValueError, TypeError):  # a negative code, or not ints at all
            pass
        else:
            if len(flags) == n and flags.count(1) + flags.count(0) == n:
                self._down = False
                return flags
        results = self._recover("exists", store.batch_is_exist, (keys,), results)
        self._check_exists(results, n)
        return results

    def _recover(self, op: str, fn: Any, args: tuple[Any, ...], results: list[int]) -> list[int]:
        """Handle an answer with negative codes: retry once after a lost master; raise.

        After a master restart the client's old RPC connection fails once at once with
        ``-900``; if the master's port then accepts a connection the call is repeated
        once (puts never overwrite and reads are idempotent), otherwise it raises
        without the ~4.4 s a second call to a dead master would cost.
        """
        if any(code in codes.UNAVAILABLE for code in results):
            self._down = True
            self._probe()
            results = self._invoke(op, fn, *args)
        self._settle(results, op)
        return results

    def _invoke(self, op: str, fn: Any, *args: Any) -> Any:
        """Call the client; exceptions from the binding become :class:`BackendError`."""
        try:
            return fn(*args)
        except Exception as exc:
            raise BackendError(f"mooncake at {self.where}: {op} raised {exc!r}") from exc

    def _settle(self, results: Sequence[int], op: str) -> None:
        """Raise for store-wide failure codes; track whether the master answers."""
        try:
            codes.raise_for_store_failure(results, op, self.where)
        except BackendUnavailable:
            self._down = True
            raise
        self._down = False

    def _replicate_config(self) -> Any:
        config = self._mc.ReplicateConfig()
        config.replica_num = self.config.replica_num
        if self.config.soft_pin:
            if hasattr(config, "soft_pin_action"):  # 0.3.13 and later
                config.soft_pin_action = self._mc.SoftPinAction.ENABLE
            else:  # earlier releases
                config.with_soft_pin = True
        return config

    # ------------------------------------------------------------------ memory
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
        start = address_of(view)
        assert start is not None
        with self._cond:
            if self._closed:
                raise BackendError(f"mooncake at {self.where}: the backend is closed")
        with self._memory_lock:
            entry = self._registry.add(view, start)
            if self._store is not None:
                self._registry.mark(entry, self._register_with(self._store, start, view.nbytes))

    def unregister_buffer(self, buffer: memoryview) -> None:
        view = as_bytes_view(buffer, "registered buffer")
        if view.readonly or view.nbytes == 0:
            return
        start = address_of(view)
        assert start is not None
        with self._memory_lock:
            entry = self._registry.remove(start)
            if entry is not None and entry.mooncake:
                self._unregister_raw(start, entry.end - start)

    def _register_with(self, store: Any, start: int, nbytes: int) -> bool:
        """Register with the client, first dropping stale ranges the new one overlaps."""
        self._drop_stale(store, start, start + nbytes)
        try:
            code = store.register_buffer(start, nbytes)
        except Exception as exc:
            code = codes.INTERNAL_ERROR
            log.debug("register_buffer raised %r", exc)
        if code != 0:
            self.counters["register_refused"] += 1
            log.warning(
                "kvconn: mooncake refused to register %d bytes at %#x (%s); transfers from "
                "that memory are copied through scratch memory until it accepts",
                nbytes,
                start,
                codes.describe(code),
            )
        return bool(code == 0)

    def _register_raw(self, start: int, nbytes: int) -> bool:
        return self._store is not None and self._register_with(self._store, start, nbytes)

    def _unregister_raw(self, start: int, nbytes: int) -> None:
        """Unregister now, or remember the range to unregister when that is safe.

        Measured: an ``unregister_buffer`` while the metadata server is unreachable
        fails (``-600``) yet leaves the range registered inside the transfer engine for
        good, and every later registration that overlaps it fails too. Freed memory is
        soon reused (the connector's next staging buffer, our scratch area), so that
        would end zero-copy for the life of the process. A range whose memory is gone
        but which is still registered is harmless as long as nothing transfers from it,
        so unregistering is deferred until the metadata server answers.
        """
        store = self._store
        if store is None or self._closed:
            return
        if self._down or not self._metadata_reachable():
            self._stale[start] = start + nbytes
            return
        try:
            code = store.unregister_buffer(start)
        except Exception as exc:
            code = codes.INTERNAL_ERROR
            log.debug("unregister_buffer raised %r", exc)
        if code != 0:
            self._stale[start] = start + nbytes
            log.warning(
                "kvconn: mooncake could not unregister %d bytes at %#x (%s)",
                nbytes,
                start,
                codes.describe(code),
            )

    def _drop_stale(self, store: Any, start: int = 0, end: int = 1 << 64) -> None:
        """Unregister deferred ranges overlapping ``[start, end)`` if now possible."""
        overlapping = [s for s, e in self._stale.items() if s < end and start < e]
        if not overlapping or not self._metadata_reachable():
            return
        for stale in overlapping:
            try:
                code = store.unregister_buffer(stale)
            except Exception:
                code = codes.INTERNAL_ERROR
            if code == 0:
                del self._stale[stale]

    def _mend_registrations(self, store: Any) -> None:
        """Finish deferred unregisters and retry refused registrations (every few s)."""
        now = time.monotonic()
        if now < self._memory_retry_at:
            return
        self._memory_retry_at = now + _MEMORY_RETRY_INTERVAL_S
        with self._memory_lock:
            self._drop_stale(store)
            for entry in self._registry.failed():
                self._registry.mark(
                    entry, self._register_with(store, entry.start, entry.end - entry.start)
                )

    def _plan(self, views: Sequence[memoryview]) -> list[_Round]:
        """Split transfers into rounds that each fit the scratch area.

        A view inside a registered range moves by its own address (zero copy); any other
        takes room in the scratch area, at most ``scratch_bytes`` per round (a larger
        single view gets a round of its own).
        """
        with self._memory_lock:
            located = self._registry.locate(views)
        if views and None not in located:  # all in registered memory: the connector's case
            n = len(views)
            return [_Round(list(range(n)), cast("list[int]", located), [-1] * n)]
        rounds: list[_Round] = []
        current = _Round()
        for i, (view, address) in enumerate(zip(views, located)):
            need = 0 if address is not None else view.nbytes
            if current.items and need and current.scratch + need > self.config.scratch_bytes:
                rounds.append(current)
                current = _Round()
            current.items.append(i)
            if address is None:
                current.offsets.append(current.scratch)
                current.scratch += need
                current.direct.append(0)
            else:
                current.offsets.append(-1)
                current.direct.append(address)
        if current.items:
            rounds.append(current)
        return rounds

    @contextlib.contextmanager
    def _memory(self, round_: _Round) -> Iterator[tuple[list[int], memoryview | None]]:
        """The round's addresses, and the scratch area (held) when the round uses it."""
        if not round_.scratch:
            yield round_.direct, None
            return
        with self._memory_lock:
            area = self._scratch.take(round_.scratch)
            base = self._scratch.address
            addresses = [
                base + offset if offset >= 0 else address
                for offset, address in zip(round_.offsets, round_.direct)
            ]
            yield addresses, area

    # ------------------------------------------------------------------ operations
    def _exists(self, keys: list[str]) -> Sequence[bool]:
        store = self._enter()
        try:
            # 1/0 per key; Backend.exists turns them into bools
            return cast("list[bool]", self._exist_codes(store, keys))
        finally:
            self._leave()

    def _check_exists(self, results: Sequence[int], n: int) -> None:
        if len(results) != n:
            raise BackendError(f"mooncake at {self.where}: is_exist answered {len(results)}/{n}")
        bad = min(results, default=0)
        if bad < 0:  # "could not ask" must never read as "absent"
            raise BackendError(
                f"mooncake at {self.where}: exists failed with {codes.describe(bad)}"
            )

    def _put(self, keys: list[str], values: list[memoryview]) -> Sequence[bool]:
        first: dict[str, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)  # first writer wins inside a batch too
        unique = list(first.values())
        stored: dict[str, bool] = {}
        store = self._enter()
        try:
            for round_ in self._plan([values[i] for i in unique]):
                batch = [unique[j] for j in round_.items]
                round_keys = [keys[i] for i in batch]
                sizes = [values[i].nbytes for i in batch]
                with self._memory(round_) as (addresses, area):
                    if area is not None:
                        for i, offset in zip(batch, round_.offsets):
                            if offset >= 0:
                                area[offset : offset + values[i].nbytes] = values[i]
                    results = self._codes(
                        "put", store.batch_put_from, round_keys, addresses, sizes, self._replicate
                    )
                    if codes.TRANSFER_FAIL in results:
                        results = self._put_on_live_segments(
                            store, round_keys, addresses, sizes, results
                        )
                copied = sum(1 for offset in round_.offsets if offset >= 0)
                self.counters["put_zero_copy"] += len(batch) - copied
                self.counters["put_scratch"] += copied
                for key, code in zip(round_keys, results):
                    ok = code in codes.PRESENT
                    stored[key] = ok
                    if not ok:
                        self._count_put_failure(key, code)
        finally:
            self._leave()
        return [stored[k] for k in keys]

    def _put_on_live_segments(
        self,
        store: Any,
        keys: list[str],
        addresses: list[int],
        sizes: list[int],
        results: list[int],
    ) -> list[int]:
        """Put again the keys whose copy was placed on a dead storage process.

        Until the master drops a dead process's segment (``client_ttl``) it keeps placing
        new objects there; their transfer fails (``-800``) and the key stays absent.
        The segments that took this batch's other keys (or, when none landed, a recent
        batch's) are alive, so the failed keys are put once more preferring those
        (``preferred_segments``, a hint: a wrong guess only means a random placement
        again). Measured with one of two storage processes killed: about half a batch
        failed, every retried key was stored. With ``replica_num`` 2 and two segments
        every put needs the dead one: nothing lands, and nothing is retried.
        """
        config = self._replicate_config()
        if not hasattr(config, "preferred_segments"):
            return results
        live = self._live_segments(store, [k for k, c in zip(keys, results) if c in codes.PRESENT])
        if not live:
            return results
        config.preferred_segments = live
        retry = [i for i, code in enumerate(results) if code == codes.TRANSFER_FAIL]
        again = self._codes(
            "put",
            store.batch_put_from,
            [keys[i] for i in retry],
            [addresses[i] for i in retry],
            [sizes[i] for i in retry],
            config,
        )
        results = list(results)
        for i, code in zip(retry, again):
            results[i] = code
        self.counters["put_rerouted"] += sum(1 for code in again if code in codes.PRESENT)
        return results

    def _live_segments(self, store: Any, landed: list[str]) -> list[str]:
        """Segments that just took a put: where the replicas of ``landed`` keys lie.

        Remembered for a while (``AVOID_S``), so a batch none of whose keys landed can
        use the last answer. Endpoints a read found dead are left out (a key that was
        already stored, answered as landed, may have its copy on the dead one). Asking
        fails softly: the put it serves has partly succeeded already.
        """
        now = time.monotonic()
        live: list[str] = []
        if landed:
            try:
                stored = self._stored_sizes(store, landed[:8])
            except BackendError:
                stored = {}
            live = sorted({c.endpoint for found in stored.values() for c in found.copies})
            if live:
                self._live = (live, now + AVOID_S)
        if not live and self._live[1] > now:
            live = self._live[0]
        reader = self._reader
        avoid = reader.failed_endpoints() if reader is not None else set()
        return [endpoint for endpoint in live if endpoint not in avoid]

    def _count_put_failure(self, key: str, code: int) -> None:
        if code in codes.FULL:
            self.counters["put_full"] += 1  # eviction lags a fast writer: a dropped save
        else:
            self.counters["put_failed"] += 1
            log.debug("kvconn: mooncake put of %r failed with %s", key, codes.describe(code))

    def _get_scratch(self, keys: list[str], buffers: list[memoryview]) -> Sequence[bool]:
        """Read without asking sizes first: the caller's buffers are scratch.

        ``batch_get_into`` refuses a buffer smaller than the value (``-600``, nothing
        written) and reports a shorter value by its length after copying it, so a
        wrong size is still told apart; only the bytes a failed key leaves behind
        differ, and scratch buffers may hold those. That saves the replica-descriptor
        RPC, as costly as the transfer itself for values of tens of KiB. Copies are only
        described for keys whose transfer failed, to read them from another replica.
        """
        groups = _positions(keys)
        if len(groups) < len(keys) and any(
            len({buffers[i].nbytes for i in positions}) > 1 for positions in groups.values()
        ):
            return self._get(keys, buffers)  # one key into buffers of two sizes: ask first
        ok = [False] * len(keys)
        store = self._enter()
        try:
            reader = self._reader  # after _enter: a delayed set-up makes it
            if reader is not None and reader.failed_endpoints():
                return self._get(keys, buffers)  # a copy failed lately: steer around it
            reads = [_Pending(key, p[0], p[1:], None) for key, p in groups.items()]
            failed = self._read_through_client(store, reader, reads, buffers, ok)
            if failed and reader is not None:
                self._read_described(store, reader, failed, buffers, ok)
        finally:
            self._leave()
        return ok

    def _read_described(
        self,
        store: Any,
        reader: ReplicaReader,
        reads: list[_Pending],
        buffers: list[memoryview],
        ok: list[bool],
    ) -> None:
        """Reads whose transfer failed unchecked: ask where copies are, read a live one."""
        stored = self._stored_sizes(store, [r.key for r in reads])
        retry: list[_Pending] = []
        for read in reads:
            found = stored.get(read.key)
            if found is None:
                self.counters["get_miss"] += read.wanted
            elif found.size != buffers[read.target].nbytes:
                self.counters["get_wrong_size"] += read.wanted
            elif len(found.copies) > 1:
                retry.append(_Pending(read.key, read.target, read.duplicates, found))
            else:
                reader.mark_failed(c.endpoint for c in found.copies)
                self.counters["get_failed"] += read.wanted
        if retry:
            self._read_from_replicas(reader, retry, buffers, ok)

    def _get(self, keys: list[str], buffers: list[memoryview]) -> Sequence[bool]:
        groups = _positions(keys)
        ok = [False] * len(keys)
        store = self._enter()
        try:
            stored = self._stored_sizes(store, list(groups))
            reader = self._reader
            avoid = reader.failed_endpoints() if reader is not None else set()
            direct: list[_Pending] = []  # through the client
            rerouted: list[_Pending] = []  # copies on an endpoint known to fail: bypass it
            for key, positions in groups.items():
                found = stored.get(key)
                if found is None:
                    self.counters["get_miss"] += len(positions)
                    continue
                fitting = [i for i in positions if buffers[i].nbytes == found.size]
                self.counters["get_wrong_size"] += len(positions) - len(fitting)
                if not fitting:
                    continue
                pending = _Pending(key, fitting[0], fitting[1:], found)
                if reader is not None and reader.should_bypass(found, avoid):
                    rerouted.append(pending)
                else:
                    direct.append(pending)
            rerouted += self._read_through_client(store, reader, direct, buffers, ok)
            if rerouted and reader is not None:
                self._read_from_replicas(reader, rerouted, buffers, ok)
        finally:
            self._leave()
        return ok

    def _read_through_client(
        self,
        store: Any,
        reader: ReplicaReader | None,
        reads: list[_Pending],
        buffers: list[memoryview],
        ok: list[bool],
    ) -> list[_Pending]:
        """``batch_get_into``; returns the failed reads another replica could serve."""
        retry: list[_Pending] = []
        targets = [buffers[r.target] for r in reads]
        for round_ in self._plan(targets):
            round_reads = [reads[j] for j in round_.items]
            lengths = [targets[j].nbytes for j in round_.items]
            with self._memory(round_) as (addresses, area):
                results = self._codes(
                    "get", store.batch_get_into, [r.key for r in round_reads], addresses, lengths
                )
                for n, (read, code) in enumerate(zip(round_reads, results)):
                    offset = round_.offsets[n]
                    if code == lengths[n]:
                        self._finish(read, buffers, ok, area, offset)
                    elif code == codes.TRANSFER_FAIL and reader is not None:
                        self.counters["get_transfer_failed"] += 1
                        # The chosen copy's process is gone but the master still lists
                        # it. With one copy, remember its endpoint so keys that also
                        # have a copy elsewhere skip it; with more (or not yet known),
                        # try those.
                        if read.stored is None or len(read.stored.copies) > 1:
                            retry.append(read)
                        else:
                            reader.mark_failed(c.endpoint for c in read.stored.copies)
                            self._count_get_failure(read, code, lengths[n], offset >= 0)
                    elif read.stored is None and (code >= 0 or code == codes.INVALID_PARAMS):
                        # Sizes were not asked: the value is shorter than the buffer
                        # (its bytes are in the scratch buffer) or longer (-600, none).
                        self.counters["get_wrong_size"] += read.wanted
                    else:
                        self._count_get_failure(read, code, lengths[n], offset >= 0)
        return retry

    def _read_from_replicas(
        self,
        reader: ReplicaReader,
        reads: list[_Pending],
        buffers: list[memoryview],
        ok: list[bool],
    ) -> None:
        """Read keys from explicit replicas, skipping endpoints whose transfers failed.

        Every read here has been described (``stored`` is set): copies are only known so.
        """
        targets = [buffers[r.target] for r in reads]
        for round_ in self._plan(targets):
            round_reads = [reads[j] for j in round_.items]
            described = [cast("Stored", r.stored) for r in round_reads]
            with self._memory(round_) as (addresses, area):
                done = reader.read(
                    [
                        Read(r.key, address, d.size, d.copies)
                        for r, d, address in zip(round_reads, described, addresses)
                    ]
                )
                for n, (read, success) in enumerate(zip(round_reads, done)):
                    if success:
                        self._finish(read, buffers, ok, area, round_.offsets[n], failover=True)
                    else:
                        self.counters["get_failed"] += read.wanted
                        log.debug("kvconn: mooncake get of %r failed on every replica", read.key)

    def _finish(
        self,
        read: _Pending,
        buffers: list[memoryview],
        ok: list[bool],
        area: memoryview | None,
        offset: int,
        *,
        failover: bool = False,
    ) -> None:
        """A read landed: copy it out of scratch if it went there, and to duplicates."""
        target = buffers[read.target]
        if area is not None and offset >= 0:
            target[:] = area[offset : offset + target.nbytes]
            self.counters["get_scratch"] += 1
        else:
            self.counters["get_zero_copy"] += 1
        if failover:
            self.counters["get_failover"] += 1
        ok[read.target] = True
        for other in read.duplicates:
            buffers[other][:] = target
            ok[other] = True

    def _count_get_failure(
        self, read: _Pending, code: int, expected: int, via_scratch: bool
    ) -> None:
        """Count a failed read once per buffer that wanted the key, as misses found
        before reading are."""
        key, wanted = read.key, read.wanted
        if code in codes.ABSENT:
            self.counters["get_miss"] += wanted  # evicted or removed since the size query
        elif code >= 0:
            # The value changed size between the size query and the read, which the
            # read lease forbids short of a forced remove and a new put under the same
            # key. Through scratch the caller's buffer is untouched; a registered one
            # may hold the first bytes of the new value: say so loudly.
            self.counters["get_wrong_size"] += wanted
            level = logging.DEBUG if via_scratch else logging.ERROR
            log.log(
                level,
                "kvconn: mooncake value %r changed size during a read (%d, expected %d)",
                key,
                code,
                expected,
            )
        else:
            self.counters["get_failed"] += wanted  # e.g. -800: its segment's process died
            log.debug("kvconn: mooncake get of %r failed with %s", key, codes.describe(code))

    def _stored_sizes(
        self, store: Any, keys: list[str], retried: bool = False
    ) -> dict[str, Stored]:
        """Size and copies of each key that has a complete replica; raises if the store failed.

        ``batch_get_replica_desc`` leaves out absent keys *and* answers ``{}`` when the
        master is down, so keys it leaves out are confirmed with ``batch_is_exist``,
        which reports a failure as a code. Only misses pay for that second RPC.
        """
        described = self._invoke("batch_get_replica_desc", store.batch_get_replica_desc, keys)
        complete = self._mc.ReplicaStatus.COMPLETE
        stored: dict[str, Stored] = {}
        for key, replicas in described.items():
            size = -1
            copies: list[Copy] = []
            for replica in replicas:
                if replica.status != complete:
                    continue  # a put in flight, or a replica being removed
                if replica.is_memory_replica():
                    buffer = replica.get_memory_descriptor().buffer_descriptor
                    if size in (-1, int(buffer.size)):
                        size = int(buffer.size)
                        copies.append(
                            Copy(str(buffer.transport_endpoint), int(buffer.buffer_address))
                        )
                elif size == -1:
                    size = int(replica.get_disk_descriptor().object_size)
            if size >= 0:
                stored[key] = Stored(size, tuple(copies))
        unknown = [k for k in keys if k not in stored]
        if not unknown:
            self._down = False
            return stored
        results = self._exist_codes(store, unknown)
        present = [k for k, r in zip(unknown, results) if r == 1]
        if present and not retried:  # an answer lost to a restart, or a put just finished
            stored.update(self._stored_sizes(store, present, retried=True))
        return stored

    def _delete(self, keys: list[str]) -> Sequence[bool]:
        """``batch_remove(force=True)``: every read takes a 10 s lease that blocks removal."""
        unique = list(dict.fromkeys(keys))
        store = self._enter()
        try:
            results = self._codes("delete", store.batch_remove, unique, True)
            removed: dict[str, bool] = {}
            for key, code in zip(unique, results):
                if code == codes.OK:
                    removed[key] = True
                elif code == codes.OBJECT_NOT_FOUND:
                    removed[key] = False
                else:
                    raise BackendError(
                        f"mooncake at {self.where}: remove of {key!r} failed with "
                        f"{codes.describe(code)}"
                    )
        finally:
            self._leave()
        return [removed[k] for k in keys]


def _tcp_problem(target: tuple[str, int], timeout: float) -> str | None:
    """Why a TCP connection to ``target`` fails, or None when it is accepted."""
    try:
        socket.create_connection(target, timeout=timeout).close()
    except OSError as exc:
        return str(exc) or type(exc).__name__
    return None


@dataclass(slots=True)
class _Pending:
    """A key to read once: the buffer it lands in, and buffers that want the same key."""

    key: str
    target: int
    duplicates: list[int]
    stored: Stored | None  # None: read without asking the size and copies first

    @property
    def wanted(self) -> int:
        """Buffers that wanted the key: a failure is counted once per buffer."""
        return 1 + len(self.duplicates)


def _positions(keys: list[str]) -> dict[str, list[int]]:
    """Each distinct key and where it appears in the batch, in first-seen order."""
    if len(set(keys)) == len(keys):  # the usual batch, checked at C speed
        return {key: [i] for i, key in enumerate(keys)}
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return groups


@dataclass
class _Round:
    """One client call's share of a batch: item indices and where each item's bytes are."""

    items: list[int] = field(default_factory=list)
    direct: list[int] = field(default_factory=list)  # address, for registered memory
    offsets: list[int] = field(default_factory=list)  # scratch offset, or -1 when direct
    scratch: int = 0  # scratch bytes the round needs


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """Set one environment variable for the duration of a block (setup() reads it)."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous
