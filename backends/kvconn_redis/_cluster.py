"""Redis Cluster over the same zero-copy RESP path as a single server.

Why not redis-py's ``RedisCluster``: its pipeline copies every value through ``bytes``
objects (socket → parser buffer → ``bytes`` → the caller's buffer) and encodes every
put through its own writer; at KV-page sizes those copies cost more than the network.
Routing a batch is little code once the single-server path is split into reusable
pieces (:mod:`kvconn_redis._resp`):

* a key's slot is CRC16 of the key, or of its ``{hash tag}`` (:func:`key_slot`);
* the slot map comes from ``CLUSTER SLOTS`` of any node that answers (the URL's seeds
  the first time);
* every primary is a :class:`~kvconn_redis._resp.Node`: pooled connections with the
  deployment's TLS, credentials, timeouts and ``max_connections``;
* a batch is split by node, and :func:`~kvconn_redis._resp.run_jobs` sends every node's
  share before it reads any reply: one round trip per node, the nodes overlapping.
  Values leave from and arrive in the caller's buffers, as with one server.

Redirections: ``-MOVED slot host:port`` for some keys means the map is stale (a
failover, a finished migration): it is read again and only those keys are sent again
(they did not run), to their new node. ``-ASK slot host:port`` (a slot half-way through
a migration, the key already moved or new) sends those keys to the importing node
behind ``ASKING``. Keys still redirected after three follow-ups are an outage of the
moment (:class:`BackendUnavailable`), like ``TRYAGAIN`` and ``CLUSTERDOWN`` replies.

A node that cannot be reached fails the whole batch with :class:`BackendUnavailable`
(the connector serves that as misses) once the other nodes' replies were read, so their
connections stay usable; the next call reads the slot map again, in case the node was
replaced.
"""

from __future__ import annotations

import binascii
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvconn.errors import BackendError, BackendUnavailable
from kvconn_redis._config import RedisConfig
from kvconn_redis._resp import (
    Commands,
    ErrorReply,
    HandshakeError,
    Job,
    Node,
    RespConnection,
    encode_command,
    error_for,
    filled,
    flag,
    run_jobs,
    scan_node,
    stored,
)

__all__ = ["ClusterClient", "key_slot"]

SLOTS = 16384
#: Rounds of re-sending redirected keys before giving up: enough for MOVED, then ASK at
#: the new owner, then the answer; more only delays the misses while a cluster reshards.
_REDIRECTS = 3
_CLUSTER_SLOTS = encode_command(b"CLUSTER", b"SLOTS")
_REDIRECTIONS = ("MOVED", "ASK")

Address = tuple[str, int]
#: ``encode(indices, asking)``: request parts for those keys of the batch.
Encode = Callable[[list[int], list[bool] | None], Sequence[bytes | memoryview]]
#: ``read(indices, asking)``: what reads their replies, one per key.
Read = Callable[[list[int], list[bool] | None], Callable[[RespConnection], Sequence[Any]]]


def key_slot(key: bytes) -> int:
    """The cluster slot of a key: CRC16 (XMODEM) of the key, or of its hash tag.

    The hash tag is what lies between the first ``{`` and the next ``}``, when that is
    not empty; Redis hashes only that so related keys can share a slot. A ``key_prefix``
    like ``{tenant}/`` therefore puts every page on one node, as Redis promises for tags.
    """
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return binascii.crc_hqx(key, 0) % SLOTS


@dataclass(frozen=True)
class _SlotMap:
    """Which node serves each slot; replaced whole, never changed, so readers need no lock."""

    owners: tuple[Node | None, ...]  # by slot; None: no node serves it (yet)
    primaries: tuple[Node, ...]  # sorted by address


def _address(node: Node) -> Address:
    assert node.address is not None  # cluster nodes are TCP
    return node.address


class ClusterClient:
    """Batched exists/put/get/delete/scan against a Redis Cluster; shared by threads."""

    def __init__(self, config: RedisConfig) -> None:
        self.config = config
        self.where = config.where
        self._ssl = config.ssl_context() if config.tls else None  # bad files: ConfigError now
        self._commands = Commands(config)
        self._nodes: dict[Address, Node] = {}
        self._nodes_lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._map: _SlotMap | None = None
        #: A node failed: the next call reads the map first (it may have been replaced).
        self._stale = False
        #: Nodes whose last batch could not reach them: asked for the map last.
        self._down: set[Address] = set()
        self._closed = False
        self._pid = os.getpid()

    def _after_fork(self) -> None:
        """A forked child gets fresh locks: the parent's may have been held by a thread
        that does not exist here. The map stays valid; each node's pool drops the
        parent's connections by itself."""
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._nodes_lock = threading.Lock()
            self._refresh_lock = threading.Lock()

    # ------------------------------------------------------------------ nodes and slots
    def _node(self, address: Address) -> Node:
        node = self._nodes.get(address)
        if node is None:
            with self._nodes_lock:
                if self._closed:
                    raise BackendError(f"redis at {self.where}: the backend is closed")
                node = self._nodes.get(address)
                if node is None:
                    host, port = address
                    shown = f"[{host}]" if ":" in host else host
                    scheme = "rediss" if self.config.tls else "redis"
                    node = Node(self.config, address, self._ssl, f"{scheme}://{shown}:{port}")
                    self._nodes[address] = node
        return node

    def _slot_map(self, op: str) -> _SlotMap:
        # Loaded lazily: a cluster that is down when the backend is made only means
        # errors until it is up.
        self._after_fork()
        smap = self._map
        if smap is None or self._stale:
            smap = self._refresh(op, smap)
        return smap

    def _refresh(
        self, op: str, seen: _SlotMap | None, moved: dict[int, Node] | None = None
    ) -> _SlotMap:
        """Read the slot map again, unless another thread did since ``seen`` was current.

        ``moved``: slot owners named by ``MOVED`` replies, which are fresher than what a
        node not yet reached by the cluster's gossip may answer.
        """
        with self._refresh_lock:
            current = self._map
            if current is not None and current is not seen:
                return current
            known = [_address(n) for n in current.primaries] if current else []
            candidates = list(dict.fromkeys([*known, *self.config.nodes]))
            candidates.sort(key=lambda address: address in self._down)  # stable: down ones last
            problems: list[BackendError] = []
            for address in candidates:
                node = self._node(address)
                try:
                    reply = node.run(op, [_CLUSTER_SLOTS], lambda c: c.read_reply())
                except HandshakeError:
                    raise  # the same options are refused by every node
                except BackendError as exc:
                    problems.append(exc)
                    continue
                if isinstance(reply, ErrorReply):
                    if "cluster support disabled" in reply.message:
                        raise HandshakeError(
                            f"redis at {node.where} is not a cluster node ({reply.message}); "
                            "use a redis:// URL without cluster=True"
                        )
                    problem = error_for(reply, "CLUSTER SLOTS", node.where)
                    if isinstance(problem, HandshakeError):
                        raise problem  # NOAUTH / NOPERM: every node says the same
                    problems.append(problem)
                    continue
                smap = self._parse(reply, node, moved or {})
                self._map = smap
                self._stale = False
                self._retire_all_but(smap.primaries)
                return smap
            raise BackendUnavailable(
                f"redis at {self.where}: {op} failed: no node answered CLUSTER SLOTS "
                f"(last: {problems[-1]})"
            )

    def _retire_all_but(self, primaries: tuple[Node, ...]) -> None:
        """Forget nodes outside the new map, closing their idle connections.

        A node that left the cluster (or serves no slot any more) would otherwise keep
        its sockets open until :meth:`close`. Seeds are asked again through a new node.
        """
        keep = {id(node) for node in primaries}
        with self._nodes_lock:
            gone = [a for a, node in self._nodes.items() if id(node) not in keep]
            retired = [self._nodes.pop(address) for address in gone]
        for node in retired:
            node.retire()

    def _parse(self, reply: Any, asked: Node, moved: dict[int, Node]) -> _SlotMap:
        """``CLUSTER SLOTS``: ``[[first, last, [host, port, id, …], replicas…], …]``."""
        if not isinstance(reply, list):
            raise BackendError(f"redis at {asked.where}: CLUSTER SLOTS answered {reply!r}")
        owners: list[Node | None] = [None] * SLOTS
        for entry in reply:
            if not (
                isinstance(entry, list)
                and len(entry) >= 3
                and isinstance(entry[0], int)
                and isinstance(entry[1], int)
                and 0 <= entry[0] <= entry[1] < SLOTS
                and isinstance(entry[2], list)
                and len(entry[2]) >= 2
                and isinstance(entry[2][0], bytes)
                and isinstance(entry[2][1], int)
            ):
                raise BackendError(
                    f"redis at {asked.where}: CLUSTER SLOTS answered an entry {entry!r}"
                )
            first, last = entry[0], entry[1]
            host = entry[2][0].decode("utf-8", "replace")
            if host == "?":
                continue  # that node does not know the owner's address yet: unserved for now
            if not host:
                host = _address(asked)[0]  # "": the address this node was reached at
            owners[first : last + 1] = [self._node((host, entry[2][1]))] * (last - first + 1)
        for slot, node in moved.items():
            # Through _node(): the object MOVED named may have been retired meanwhile.
            owners[slot] = self._node(_address(node))
        primaries = sorted({n for n in owners if n is not None}, key=_address)
        return _SlotMap(tuple(owners), tuple(primaries))

    def _redirect(self, reply: ErrorReply, node: Node) -> tuple[int, Node | None]:
        """``MOVED|ASK <slot> <host>:<port>``: the slot and the node to ask instead.

        None when the replying node does not know that node's address yet (``?``).
        """
        fields = reply.message.split()
        host, colon, port = fields[2].rpartition(":") if len(fields) == 3 else ("", "", "")
        if not (colon and port.isdigit() and fields[1].isdigit()):
            raise BackendError(f"redis at {node.where}: a malformed redirection {reply.message!r}")
        if host == "?":
            return int(fields[1]), None
        return int(fields[1]), self._node((host or _address(node)[0], int(port)))

    # ------------------------------------------------------------------ batches
    def _slots(self, keys: Sequence[str]) -> list[int]:
        prefix = self._commands.prefix
        if b"{" in prefix or "{" in "".join(keys):
            return [key_slot(prefix + k.encode("ascii")) for k in keys]
        # No hash tags: CRC16 continues over the key from the prefix's, computed once.
        start = binascii.crc_hqx(prefix, 0)
        return [binascii.crc_hqx(k.encode("ascii"), start) % SLOTS for k in keys]

    def _route(
        self,
        op: str,
        keys: Sequence[str],
        encode: Encode,
        read: Read,
        finish: Callable[[Any, str, str], bool],
        *,
        retry: bool = True,
    ) -> list[bool]:
        """Run one batched command across the cluster; per key, ``finish(reply, op, where)``.

        Only keys the server did not run come back for another round: redirected ones,
        and ones whose slot the map gave no node.
        """
        slots = self._slots(keys)
        results = [False] * len(keys)
        pending = list(range(len(keys)))
        asked: dict[int, Node] = {}  # key index -> the node importing its slot
        smap = self._slot_map(op)
        for _ in range(_REDIRECTS + 1):
            groups: dict[Node, list[int]] = {}
            unserved: list[int] = []
            owners = smap.owners
            for i in pending:
                owner = asked.get(i) if asked else None
                owner = owner or owners[slots[i]]
                if owner is None:
                    unserved.append(i)
                else:
                    groups.setdefault(owner, []).append(i)
            shares = sorted(groups.items(), key=lambda item: _address(item[0]))
            jobs = []
            for node, indices in shares:
                asking: list[bool] | None = [i in asked for i in indices] if asked else None
                if asking is not None and not any(asking):
                    asking = None  # the fast reply decoder, for nodes asked nothing special
                jobs.append(
                    Job(node, op, encode(indices, asking), read(indices, asking), retry=retry)
                )
            run_jobs(jobs)
            self._check_jobs(jobs)
            again: list[int] = []
            moved: dict[int, Node] = {}
            refresh = bool(unserved)
            for job, (node, indices) in zip(jobs, shares):
                where = node.where
                for i, reply in zip(indices, job.value()):
                    if reply.__class__ is not ErrorReply or reply.code not in _REDIRECTIONS:
                        results[i] = finish(reply, op, where)
                        continue
                    slot, target = self._redirect(reply, node)
                    if reply.code == "MOVED":
                        asked.pop(i, None)
                        refresh = True
                        if target is not None:
                            moved[slot] = target
                    elif target is None:
                        raise BackendUnavailable(
                            f"redis at {where}: {op} failed: {reply.message} "
                            "(the importing node's address is not known yet)"
                        )
                    else:
                        asked[i] = target
                    again.append(i)
            if not again and not unserved:
                return results
            if refresh:
                smap = self._refresh(op, smap, moved)
            pending = again + unserved
        slot = slots[pending[0]]
        raise BackendUnavailable(
            f"redis at {self.where}: {op} failed: slot {slot} still had no settled node "
            f"after {_REDIRECTS} redirections or map reloads (the cluster is resharding "
            "or some slots are not served)"
        )

    def _check_jobs(self, jobs: Sequence[Job[Any]]) -> None:
        """Raise the first node's failure; remember unreachable nodes for the next map read."""
        failure: BackendError | None = None
        for job in jobs:
            address = _address(job.node)
            if job.error is None:
                self._down.discard(address)
                continue
            failure = failure or job.error
            if isinstance(job.error, BackendUnavailable):
                self._down.add(address)
                self._stale = True
        if failure is not None:
            raise failure

    # ------------------------------------------------------------------ operations
    def ping(self) -> None:
        self._slot_map("connect")

    def close(self) -> None:
        self._after_fork()
        with self._nodes_lock:
            self._closed = True
            nodes = list(self._nodes.values())
        for node in nodes:
            node.close()

    def _flags(self, op: str, command: bytes, keys: Sequence[str], *, retry: bool) -> list[bool]:
        """One-key EXISTS or DEL per key."""
        one_key = self._commands.one_key

        def encode(indices: list[int], asking: list[bool] | None) -> list[bytes | memoryview]:
            return [one_key(command, [keys[i] for i in indices], asking)]

        def read(
            indices: list[int], asking: list[bool] | None
        ) -> Callable[[RespConnection], Sequence[Any]]:
            return Commands.read_flags(len(indices), asking)

        return self._route(op, keys, encode, read, flag, retry=retry)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._flags("exists", b"EXISTS", keys, retry=True)

    def delete(self, keys: Sequence[str]) -> list[bool]:
        # Not retried on a fresh connection: a DEL that ran before the old one broke
        # would then answer 0.
        return self._flags("delete", b"DEL", keys, retry=False)

    def put(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        """``SET key value NX [PX ttl]`` per key; OOM on a node is that key's ``False``."""
        sets = self._commands.sets

        def encode(indices: list[int], asking: list[bool] | None) -> list[bytes | memoryview]:
            return sets([keys[i] for i in indices], [values[i] for i in indices], asking)

        def read(
            indices: list[int], asking: list[bool] | None
        ) -> Callable[[RespConnection], Sequence[Any]]:
            return Commands.read_replies(len(indices), asking)

        return self._route("put", keys, encode, read, stored)

    def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """``GET`` per key into its buffer after a size check, as on one server.

        A redirected key's buffer is untouched by the redirection reply and filled by the
        node asked next. If this raises, any buffer of the batch may hold part of a value.
        """
        one_key = self._commands.one_key

        def encode(indices: list[int], asking: list[bool] | None) -> list[bytes | memoryview]:
            return [one_key(b"GET", [keys[i] for i in indices], asking)]

        def read(
            indices: list[int], asking: list[bool] | None
        ) -> Callable[[RespConnection], Sequence[Any]]:
            return Commands.read_values([buffers[i] for i in indices], asking)

        return self._route("get", keys, encode, read, filled)

    def scan(self, prefix: str) -> Iterator[tuple[str, int]]:
        """SCAN + STRLEN on every primary in turn."""
        seen: set[bytes] = set()
        for node in self._slot_map("list").primaries:
            yield from scan_node(node, self._commands.prefix, prefix, seen)
