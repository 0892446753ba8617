"""One Mooncake client's life: set-up behind a probe, calls in flight, close.

Measured with 0.3.13 (``docs/notes/mooncake-api.md``), and what each fact costs here:

* Calling the client before ``setup()`` succeeded or after ``close()`` crashes the
  process (SIGSEGV), so every call enters the session first (:meth:`Session.enter`):
  after :meth:`Session.close` it raises :class:`BackendError`; while the master was
  unreachable at start it retries ``setup()`` (behind the probe below) and raises until
  that works. :meth:`Session.close` waits for calls in flight.
* ``-900`` (master unreachable) raises :class:`BackendUnavailable`. Against a dead master
  Mooncake blocks each call ~4.4 s and no timeout knob shortens it, so after one such
  failure the session first tries a TCP connection to the master (``probe_timeout_s``)
  and raises at once while that is refused: a dead master costs at most one slow call,
  not one per request. A master that accepts connections but does not answer still
  costs ~4.4 s per call (the connector's ``retry_interval_s`` back-off bounds how
  often). After a master restart the client's first call fails once with ``-900``; when
  the probe then connects, the call is repeated once, so a restart drops nothing. The
  restarted master has lost every object (its metadata lives only there).
* The client is set up with a transfer engine the session starts itself, so reads can
  pick their replica (:mod:`kvconn_mooncake._replicas`); the session owns the
  :class:`~kvconn_mooncake._replicas.ReplicaReader` over it, for the transfers to use.

Threads: the client's methods may be called from several threads at once. Its Python
binding releases the GIL in every call that moves bytes or asks the master
(``batch_is_exist``, ``batch_put_from``, ``batch_get_into``, ``batch_get_replica_desc``,
``batch_remove``, ``register_buffer``), and the client guards its own state (RPC client
pools, registered buffers); Mooncake's own ``structured_object_store`` calls
``batch_put_from`` from a thread pool. Not so ``setup()`` and ``close()``, which keep the
GIL: a set-up delayed to a call (the master was down at start) stalls every Python
thread of the process while it runs; ``close()`` waits for calls in flight. Session
state is the set-up client (made once, under ``_setup_lock``), the count of calls in
flight (under ``_state``), and ``down``, a hint any thread may set: the worst a race on
it costs is one probe more or less.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Sequence
from typing import Any

from kvconn.errors import BackendError, BackendUnavailable, ConfigError
from kvconn_mooncake import _codes as codes
from kvconn_mooncake import _library
from kvconn_mooncake._config import MooncakeConfig
from kvconn_mooncake._counters import Counters
from kvconn_mooncake._flight import Flight
from kvconn_mooncake._memory import Memory
from kvconn_mooncake._replicas import ReplicaReader, make_engine

log = logging.getLogger(__name__)

SETUP_RETRIES_ENV = "MC_STORE_CLIENT_SETUP_RETRIES"
#: ``setup()`` attempts when neither the option nor the variable says: the TCP probe
#: already covers a master that is simply not up (Mooncake's own default is 20).
DEFAULT_SETUP_RETRIES = 3


class Session:
    """The set-up client (``store``), the calls using it, and its replica reader."""

    def __init__(self, mc: Any, config: MooncakeConfig, counters: Counters) -> None:
        self.mc = mc
        self.config = config
        self.where = config.master_address
        self.counters = counters
        #: The set-up ``MooncakeDistributedStore``; None before set-up and after close.
        self.store: Any = None
        #: Reads from explicit replicas through the client's transfer engine (None: off).
        self.reader: ReplicaReader | None = None
        #: The last call found the master unreachable: probe before the next one.
        self.down = False
        self.memory = Memory(self, counters, config.scratch_bytes)
        #: Keys moving at once, the client's and the reader's calls together.
        self.flight = Flight(config.transfers_in_flight)
        self._state = threading.Lock()  # guards _active / _closed; _cond waits on it
        self._cond = threading.Condition(self._state)
        self._active = 0
        self._closed = False
        self._setup_lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self) -> None:
        """Set the client up; a master that refuses connections is only a warning.

        It may come up later, and until it does every call raises
        :class:`BackendUnavailable`, which the connector serves as misses. A master that
        accepts connections while ``setup()`` still fails (wrong metadata server,
        protocol or device) is a :class:`ConfigError`: retrying would not fix it.
        """
        try:
            self._connect(at_start=True)
        except BackendUnavailable as exc:
            log.warning("kvconn: %s; calls will fail until it answers", exc)

    def check_open(self) -> None:
        with self._cond:
            if self._closed:
                raise BackendError(f"mooncake at {self.where}: the backend is closed")

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
        self.memory.forget()
        store, self.store = self.store, None
        if store is not None:
            with contextlib.suppress(Exception):
                store.close()
        self.reader = None  # the engine goes after the client that shares it

    # ------------------------------------------------------------------ set-up
    def _connect(self, *, at_start: bool) -> None:
        """``setup()`` a new client, behind a TCP probe of the master; register memory."""
        self.probe()
        store = self.mc.MooncakeDistributedStore()
        retries = self._setup_retries()
        shared = self._engine() if self.config.read_failover else None
        with _library.environment(SETUP_RETRIES_ENV, str(retries)):
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
                f"mooncake: setup() against master {self.where} failed "
                f"({codes.describe(code)}); check metadata_server "
                f"({self.config.metadata_server!r}), protocol ({self.config.protocol!r}) and "
                f"device_name ({self.config.device_name!r})"
            )
            if at_start:
                raise ConfigError(message)
            raise BackendUnavailable(message)
        self.memory.attach(store)
        # The reader first: a call on another thread that finds ``store`` set takes the
        # fast path in enter() and reads ``reader`` next; it must not find it unset.
        self.reader = ReplicaReader(shared[0], self.flight) if shared is not None else None
        self.down = False
        self.store = store

    def _setup_retries(self) -> int:
        if self.config.setup_retries is not None:
            return self.config.setup_retries
        text = os.environ.get(SETUP_RETRIES_ENV, str(DEFAULT_SETUP_RETRIES))
        if not text.strip().isdigit() or int(text) < 1:
            raise ConfigError(
                f"mooncake: environment variable {SETUP_RETRIES_ENV} must be an int >= 1, "
                f"got {text!r}"
            )
        return int(text)

    def _engine(self) -> tuple[Any, str] | None:
        """A transfer engine for the client to share, so reads can pick their replica."""
        try:
            mooncake_engine = _library.load("engine")
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

    def probe(self) -> None:
        """Fail fast when the master's port refuses connections (see the module doc)."""
        target = self.config.master_host_port
        if target is None:
            return
        problem = _tcp_problem(target, self.config.probe_timeout_s)
        if problem is not None:
            self.counters.add("refused_master_down")
            raise BackendUnavailable(f"mooncake master at {self.where} is unreachable ({problem})")

    def metadata_reachable(self) -> bool:
        """Whether the transfer-engine metadata server accepts connections (or is none).

        Registering and unregistering memory publish the client's segment there; see
        :meth:`Memory.unregister_range` for why that must not be tried while it is down.
        """
        target = self.config.metadata_host_port
        return target is None or _tcp_problem(target, self.config.probe_timeout_s) is None

    # ------------------------------------------------------------------ calls
    def enter(self) -> Any:
        """The set-up client, for one call; never once closed (that would crash).

        Every successful ``enter`` is paired with :meth:`leave` (``try/finally``), so
        :meth:`close` can wait for calls in flight. Plain methods rather than a context
        manager: this runs on every call, and ``exists`` is only ~0.1 ms of RPC.
        """
        with self._state:  # the lock itself: Condition.__enter__ is a Python-level call
            if self._closed:
                raise BackendError(f"mooncake at {self.where}: the backend is closed")
            self._active += 1
        store, memory = self.store, self.memory
        if store is not None and not (self.down or memory.stale or memory.registry.any_failed):
            return store  # the common case: one test of four plain attributes
        try:
            if self.store is None:
                with self._setup_lock:
                    if self.store is None:
                        self._connect(at_start=False)
            elif self.down:
                self.probe()
            if (memory.stale or memory.registry.any_failed) and not self.down:
                memory.mend(self.store)
        except BaseException:
            self.leave()
            raise
        return self.store

    def leave(self) -> None:
        with self._state:
            self._active -= 1
            if self._closed and not self._active:  # only close() ever waits
                self._cond.notify_all()

    def invoke(self, op: str, fn: Any, *args: Any) -> Any:
        """Call the client; exceptions from the binding become :class:`BackendError`."""
        try:
            return fn(*args)
        except Exception as exc:
            raise BackendError(f"mooncake at {self.where}: {op} raised {exc!r}") from exc

    def codes(self, op: str, fn: Any, *args: Any) -> list[int]:
        """Call a client method that answers per-key codes; raise for store failures."""
        results: list[int] = self.invoke(op, fn, *args)
        if not results or min(results) >= 0:  # the common case, checked at C speed
            self.down = False
            return results
        return self._recover(op, fn, args, results)

    def moved_codes(
        self, op: str, fn: Any, keys: list[str], addresses: list[int], sizes: list[int], *extra: Any
    ) -> list[int]:
        """:meth:`codes` of a call that moves bytes (a key per request), in slices that
        keep the keys moving at once within the transport's queue (:mod:`._flight`)."""
        return self.flight.run(
            lambda k, a, n: self.codes(op, fn, k, a, n, *extra), keys, addresses, sizes
        )

    def exist_codes(self, store: Any, keys: list[str]) -> Sequence[int]:
        """``batch_is_exist``'s 1/0 per key; raises rather than answer a failure as absent.

        The check runs on every lookup and costs more than it seems: ``min()`` and
        ``map(bool)`` over 64 codes are ~3 µs here against ~90 µs for the RPC itself.
        ``bytes()`` refuses negative codes at C speed.
        """
        n = len(keys)
        results: list[int] = self.invoke("exists", store.batch_is_exist, keys)
        try:
            flags = bytes(results)
        except (ValueError, TypeError):  # a negative code, or not ints at all
            pass
        else:
            if len(flags) == n and flags.count(1) + flags.count(0) == n:
                self.down = False
                return flags
        results = self._recover("exists", store.batch_is_exist, (keys,), results)
        if len(results) != n:
            raise BackendError(f"mooncake at {self.where}: is_exist answered {len(results)}/{n}")
        bad = min(results, default=0)
        if bad < 0:  # "could not ask" must never read as "absent"
            raise BackendError(
                f"mooncake at {self.where}: exists failed with {codes.describe(bad)}"
            )
        return results

    def _recover(self, op: str, fn: Any, args: tuple[Any, ...], results: list[int]) -> list[int]:
        """Handle an answer with negative codes: retry once after a lost master; raise.

        After a master restart the client's old RPC connection fails once at once with
        ``-900``; if the master's port then accepts a connection the call is repeated
        once (puts never overwrite and reads are idempotent), otherwise it raises
        without the ~4.4 s a second call to a dead master would cost.
        """
        if any(code in codes.UNAVAILABLE for code in results):
            self.down = True
            self.probe()
            results = self.invoke(op, fn, *args)
        try:
            codes.raise_for_store_failure(results, op, self.where)
        except BackendUnavailable:
            self.down = True
            raise
        self.down = False
        return results


def _tcp_problem(target: tuple[str, int], timeout: float) -> str | None:
    """Why a TCP connection to ``target`` fails, or None when it is accepted."""
    try:
        socket.create_connection(target, timeout=timeout).close()
    except OSError as exc:
        return str(exc) or type(exc).__name__
    return None
