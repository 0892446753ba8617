"""The storage contract every backend implements: batched ``exists`` / ``put`` / ``get``.

Public methods validate once, here, then delegate to ``_exists`` / ``_put`` / ``_get``,
so every backend enforces the same key alphabet and buffer rules and a contributor only
writes the store-specific part.

Semantics a backend must keep (the shipped conformance suite checks each):

* ``exists`` answers per key, or raises :class:`BackendError` when it cannot ask —
  "could not ask" must never read as "absent".
* ``put`` never overwrites: keys are content addresses, the first writer wins, and a
  put of a present key reports success without touching the stored value.
* ``get`` fills caller-provided buffers; a stored value whose size differs from the
  buffer's is a failure and leaves the buffer untouched. With ``scratch=True`` the
  caller declares the buffers its own scratch space: a key that fails may leave any
  bytes in its buffer (a value of the wrong size is still a failure, never a success).
* ``borrow`` (optional, ``Capabilities.borrowed_reads``) lends read-only views of the
  stored values for the length of a ``with`` block, so a caller can verify and scatter
  straight from the store's memory instead of copying into staging first.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from types import TracebackType
from typing import Any, ClassVar

from kvconn.errors import InvalidKeyError

# Buffers accepted as values: anything exporting the buffer protocol.
Buffer = Any


class ReadStatus(str, Enum):
    """Why a key of a read did or did not load (:meth:`Backend.read`)."""

    LOADED = "loaded"
    MISSING = "missing"  # not stored: evicted or never written
    WRONG_SIZE = "wrong_size"  # stored, but not a value of the buffer's size: unreadable
    UNREACHABLE = "unreachable"  # stored, but its bytes could not be fetched right now
    FAILED = "failed"  # did not load; the backend cannot tell why


@dataclass(frozen=True)
class Capabilities:
    """Optional features; the connector and the conformance suite read these flags."""

    buffer_registration: bool = False  # register_buffer() enables zero-copy transfers
    delete: bool = False
    listing: bool = False
    device_pointers: bool = False  # can move bytes from/to GPU memory directly
    #: Calls may come from several threads at once. A connector serializes its calls
    #: to a backend that does not declare this (one lock per backend object).
    thread_safe: bool = False
    #: borrow() lends read-only views of stored values where the store holds them (an
    #: embedded store's memory map, a client's parsed replies), saving the copy into
    #: staging that get() makes.
    borrowed_reads: bool = False
    #: exists() answers from this host's memory or disk, never across a network (an
    #: embedded store), so a scheduler asks it on its own thread: a hand-off to a
    #: lookup thread costs more than the answer (:class:`kvconn.lookup.DeadlineLookup`).
    local: bool = False
    #: The client moves bytes on I/O threads of its own, started in the engine's process
    #: (Mooncake's transfer engine), not only on the calling thread. An idle step's load
    #: then stays on the transfer cores (:meth:`kvconn.transfer.TransferService.load_many`):
    #: on the step's core it took turns with those threads and ran slower.
    io_threads: bool = False


def as_bytes_view(value: Buffer, what: str = "value") -> memoryview:
    """A flat, contiguous byte view of ``value`` without copying it."""
    try:
        view = memoryview(value)
    except TypeError:
        raise TypeError(
            f"{what} must support the buffer protocol, got {type(value).__name__}"
        ) from None
    if not view.contiguous:
        raise ValueError(f"{what} must be a contiguous buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _views(keys: Sequence[str], buffers: Sequence[Buffer], what: str) -> list[memoryview]:
    """Byte views of a batch; an error names the key whose buffer is unusable.

    The name is only formatted on failure: a repr per key is ~0.2 µs, paid by every
    batch otherwise.
    """
    try:
        return [as_bytes_view(b) for b in buffers]
    except (TypeError, ValueError):
        for key, buffer in zip(keys, buffers):
            as_bytes_view(buffer, f"{what} for {key!r}")
        raise


def buffer_address(view: memoryview) -> int:
    """The address of a writable buffer's first byte, for backends that move raw memory."""
    if view.readonly:
        raise ValueError("a read-only buffer has no address usable for writes")
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def tensor_bytes(tensor: Any) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no numpy needed)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"only CPU tensors have a host byte view, got {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("the tensor must be contiguous")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    array_type = ctypes.c_ubyte * nbytes
    return memoryview(array_type.from_address(tensor.data_ptr())).cast("B")


class Backend(ABC):
    """A key-value store of raw byte pages."""

    #: Short name the backend registers under (entry-point group ``kvconn.backends``).
    name: ClassVar[str] = ""
    #: The ``kvconn[extra]`` that installs the client library, for error messages.
    extra: ClassVar[str | None] = None
    #: Modules that must import for the backend to work; checked lazily.
    client_modules: ClassVar[tuple[str, ...]] = ()
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: Longest key in bytes. Our keys are ~150 bytes; 250 fits every store we target.
    max_key_length: ClassVar[int] = 250

    # ------------------------------------------------------------------ public API
    def exists(self, keys: Sequence[str]) -> list[bool]:
        keys = self._check_keys(keys)
        if not keys:
            return []
        return self._checked_result(self._exists(keys), len(keys), "exists")

    def put(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        keys = self._check_keys(keys)
        if len(values) != len(keys):
            raise ValueError(f"put: {len(keys)} keys but {len(values)} values")
        views = _views(keys, values, "value")
        if not all(views):  # a view's len() is its byte count
            key = next(k for k, view in zip(keys, views) if not view)
            raise ValueError(f"put: the value for {key!r} is empty; pages are never empty")
        if not keys:
            return []
        return self._checked_result(self._put(keys, views), len(keys), "put")

    def get(
        self, keys: Sequence[str], buffers: Sequence[Buffer], *, scratch: bool = False
    ) -> list[bool]:
        """Fill ``buffers`` with the values of ``keys``; per key, whether it loaded.

        ``scratch=True`` says a failed key's buffer may be left holding anything, as a
        staging area whose pages are only used where the get succeeded. A store that
        reports a value's length only after copying it can then skip a size query (a
        round trip per batch: as costly as the transfer for small values).
        """
        keys, views = self._get_args(keys, buffers, "get")
        if not keys:
            return []
        return self._checked_result(self._get(keys, views, scratch=scratch), len(keys), "get")

    def read(
        self, keys: Sequence[str], buffers: Sequence[Buffer], *, scratch: bool = False
    ) -> list[ReadStatus]:
        """:meth:`get`, telling per key *why* a value did not load, where the store can.

        The connector repairs a page only when it is stored but unreadable
        (``WRONG_SIZE``): a page that is only ``UNREACHABLE`` right now (its holder's
        process died; another replica or a restarted segment may serve it) is a miss
        and is kept. Backends that cannot tell answer ``FAILED`` and the connector asks
        ``exists`` to tell a missing page from an unreadable one.
        """
        keys, views = self._get_args(keys, buffers, "get")
        if not keys:
            return []
        statuses = list(self._read_status(keys, views, scratch=scratch))
        if len(statuses) != len(keys):
            raise AssertionError(
                f"{self.name} backend read answered {len(statuses)} of {len(keys)} keys"
            )
        return [ReadStatus(s) for s in statuses]

    def _get_args(
        self, keys: Sequence[str], buffers: Sequence[Buffer], op: str
    ) -> tuple[list[str], list[memoryview]]:
        keys = self._check_keys(keys)
        if len(buffers) != len(keys):
            raise ValueError(f"{op}: {len(keys)} keys but {len(buffers)} buffers")
        views = _views(keys, buffers, "buffer")
        if any(view.readonly for view in views):
            key = next(k for k, view in zip(keys, views) if view.readonly)
            raise ValueError(f"{op}: the buffer for {key!r} is read-only")
        return keys, views

    def borrow(
        self, keys: Sequence[str]
    ) -> contextlib.AbstractContextManager[list[memoryview | None]]:
        """Lend the stored values of ``keys`` for the length of a ``with`` block.

        ``with backend.borrow(keys) as views:`` gives, per key, a read-only memoryview of
        the value where the store holds it, or ``None`` when the key is absent. Only with
        ``capabilities.borrowed_reads``; raises :class:`BackendError` when the store cannot
        answer, like ``exists`` (never ``None`` for "could not ask").

        Why: ``get`` copies each value into a caller's buffer, and a load then reads that
        copy twice more (checksum, scatter). A store whose values already sit in this
        process's memory can let the caller verify and scatter from there, one copy fewer.

        The views are valid only inside the block: do not keep them, or anything made
        from them (numpy arrays, tensors), past its end — the store may reuse or unmap
        that memory afterwards, and a backend may release the views so that using one
        raises. Note for implementers: while the block runs, every view must keep the
        bytes it showed when lent, whatever other processes or threads write, delete or
        resize meanwhile (LMDB: one read transaction holds the snapshot), and the store
        must stay usable by other callers.
        """
        if not self.capabilities.borrowed_reads:
            raise NotImplementedError(
                f"the {self.name!r} backend cannot lend stored values "
                "(capabilities.borrowed_reads is not declared)"
            )
        keys = self._check_keys(keys)
        if not keys:
            return contextlib.nullcontext([])
        return self._lent(keys)

    @contextlib.contextmanager
    def _lent(self, keys: list[str]) -> Iterator[list[memoryview | None]]:
        with self._borrow(keys) as views:
            if len(views) != len(keys):
                raise AssertionError(
                    f"{self.name} backend borrow answered {len(views)} of {len(keys)} keys"
                )
            yield views

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove keys; per key, whether it was present. Only with ``capabilities.delete``."""
        if not self.capabilities.delete:
            raise NotImplementedError(f"the {self.name!r} backend cannot delete")
        keys = self._check_keys(keys)
        return self._checked_result(self._delete(keys), len(keys), "delete") if keys else []

    def list_keys(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """Yield ``(key, value size)`` of stored keys starting with ``prefix``.

        A prefix outside the key alphabet (non-ASCII, a space, a control character)
        lists nothing, since no key can start with it; without this check each store
        failed on it in its own way (Redis with a ``UnicodeEncodeError``).
        :func:`kvconn.keys.spell_prefix` turns typed text into the spelling keys use.
        """
        if not self.capabilities.listing:
            raise NotImplementedError(f"the {self.name!r} backend cannot list keys")
        if not isinstance(prefix, str):
            raise InvalidKeyError(f"a key prefix must be str, got {type(prefix).__name__}")
        if prefix and not _keys_look_valid([prefix], self.max_key_length):
            return iter(())
        return self._list(prefix)

    def register_buffer(self, buffer: memoryview) -> None:
        """Announce a long-lived buffer that later puts/gets will use (zero-copy stores)."""

    def unregister_buffer(self, buffer: memoryview) -> None:
        """Undo :meth:`register_buffer` before the buffer's memory is freed."""

    def check_access(self, key_prefix: str) -> None:
        """Raise :class:`~kvconn.errors.ConfigError` if keys under ``key_prefix`` are off limits.

        Called once at start-up with what every key of the caller starts with (a
        connector's ``{namespace}/{model}/``, :func:`kvconn.keys.key_prefix`). A store
        that confines a user to some keys (Redis ACL key patterns) can tell only then
        whether kvconn's are among them; otherwise each call would be refused, served
        as a miss and logged, for as long as the deployment runs. Note for implementers:
        a store it cannot reach now is no error here (it may come up later). The default
        has nothing to check.
        """

    def close(self) -> None:
        """Release connections and handles; the backend is unusable afterwards."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @classmethod
    def client_problem(cls) -> str | None:
        """Why the client library cannot be used, or ``None`` when it imports."""
        for module in cls.client_modules:
            try:
                importlib.import_module(module)
            except Exception as exc:  # an ImportError, or a broken native library
                hint = f" (pip install 'kvconn[{cls.extra}]')" if cls.extra else ""
                return f"cannot import {module}: {exc}{hint}"
        return None

    # ------------------------------------------------------- implementer's hooks
    @abstractmethod
    def _exists(self, keys: list[str]) -> Sequence[bool]:
        """Note for implementers: raise BackendError (never return False) on failure."""

    @abstractmethod
    def _put(self, keys: list[str], values: list[memoryview]) -> Sequence[bool]:
        """Note for implementers: set-if-absent, atomically; duplicates in a batch are fine."""

    @abstractmethod
    def _get(self, keys: list[str], buffers: list[memoryview], *, scratch: bool) -> Sequence[bool]:
        """Note for implementers: a value whose size differs from its buffer's is False.

        Without ``scratch`` a failed key's buffer must stay untouched (check the size
        before copying). With ``scratch`` it may hold anything; use that only where it
        saves work (a size query per batch), else ignore the flag.
        """

    def _read_status(
        self, keys: list[str], buffers: list[memoryview], *, scratch: bool
    ) -> Sequence[ReadStatus]:
        """Note for implementers: override to tell the connector why a key failed.

        ``MISSING``: not stored. ``WRONG_SIZE``: stored, but its value is not of the
        buffer's size (the connector deletes it). ``UNREACHABLE``: stored, but its bytes
        could not be fetched now (a dead holder): a miss, and the page is kept. The
        default cannot tell and answers ``FAILED`` for every key that did not load.
        """
        return [
            ReadStatus.LOADED if ok else ReadStatus.FAILED
            for ok in self._get(keys, buffers, scratch=scratch)
        ]

    def _delete(self, keys: list[str]) -> Sequence[bool]:
        raise NotImplementedError

    def _borrow(
        self, keys: list[str]
    ) -> contextlib.AbstractContextManager[list[memoryview | None]]:
        """Note for implementers: one view (read-only) or None per key, in order, with
        duplicates answered each time; raise BackendError when the store cannot answer."""
        raise NotImplementedError(
            f"the {self.name!r} backend declares no borrowed reads (capabilities.borrowed_reads)"
        )

    def _list(self, prefix: str) -> Iterator[tuple[str, int]]:
        raise NotImplementedError

    # ------------------------------------------------------------------ checks
    def _check_keys(self, keys: Sequence[str]) -> list[str]:
        if type(keys) is VettedKeys and keys.max_length <= self.max_key_length:
            return list(keys)
        if isinstance(keys, (str, bytes)):
            raise InvalidKeyError("keys must be a sequence of str, not a single string")
        out = list(keys)
        if not _keys_look_valid(out, self.max_key_length):
            for key in out:  # the slow path finds the culprit and names it
                check_key(key, self.max_key_length)
        return out

    def _checked_result(self, result: Sequence[bool], n: int, op: str) -> list[bool]:
        out = list(map(bool, result))
        if len(out) != n:
            raise AssertionError(f"{self.name} backend {op} answered {len(out)} of {n} keys")
        return out


class VettedKeys(tuple[str, ...]):
    """A batch of keys known to be valid for any backend whose limit is ``max_length`` or more.

    Backends skip checking such a batch again. ``exists`` on a fast store is ~1.5 µs a
    key and the one-pass check ~0.1 µs: the connector's keys have fixed shapes (prefix,
    shard, group, fingerprint, hex digest) that it checks once at start-up, so checking
    them on every call would only add cost. Immutable, so what was checked is what is
    sent.
    """

    max_length: int

    def __new__(cls, keys: Sequence[str], max_length: int) -> VettedKeys:
        """Check ``keys`` (one pass), then carry the result."""
        keys = list(keys)
        if not _keys_look_valid(keys, max_length):
            for key in keys:
                check_key(key, max_length)
        return cls.unchecked(keys, max_length)

    @classmethod
    def unchecked(cls, keys: Sequence[str], max_length: int) -> VettedKeys:
        """For callers whose keys are valid by construction (the connector); no check."""
        batch = tuple.__new__(cls, keys)
        batch.max_length = max_length
        return batch


def check_key(key: object, max_length: int = 250) -> None:
    """Keys are printable ASCII without spaces: every store accepts that alphabet."""
    if not isinstance(key, str):
        raise InvalidKeyError(f"a key must be str, got {type(key).__name__}: {key!r}")
    if not key:
        raise InvalidKeyError("a key must not be empty")
    if len(key) > max_length:
        raise InvalidKeyError(
            f"key of {len(key)} characters exceeds the limit of {max_length}: {key[:40]!r}…"
        )
    # Printable ASCII has exactly one whitespace character: the space.
    if not key.isascii() or not key.isprintable() or " " in key:
        raise InvalidKeyError(f"key {key!r} must be printable ASCII without spaces")


_PRINTABLE_NO_SPACE = bytes(range(0x21, 0x7F))


def _keys_look_valid(keys: list[str], max_length: int) -> bool:
    """One pass over a whole batch: 2-3x faster than checking key by key.

    ``exists`` on a fast store is a ~100 µs round trip for 64 keys, so per-key Python
    checks would be a visible share of it.
    """
    if not keys:
        return True
    try:
        joined = "".join(keys)  # raises for anything but str: no per-key type check
    except TypeError:
        return False
    if min(map(len, keys)) == 0 or max(map(len, keys)) > max_length:
        return False
    return joined.isascii() and not joined.encode().translate(None, _PRINTABLE_NO_SPACE)
