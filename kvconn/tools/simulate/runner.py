"""The coordinator: replays the workload over TP rank processes and gathers the results.

Per request it does what an engine's scheduler does with a connector: hash the prompt's
full blocks, ask the store *once for the whole group* how long the stored prefix is
(rule 3), tell every rank to load that prefix, agree on what actually loaded (the
minimum over ranks, as SGLang's all-reduce MIN does), and tell every rank to compute
and save the rest. It never touches KV bytes itself.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any, TextIO

from kvconn.backend import Backend
from kvconn.config import ConnectorConfig
from kvconn.errors import BackendError, ConfigError, KvconnError
from kvconn.hashing import ReuseScope, block_hashes
from kvconn.keys import key_prefix
from kvconn.lookup import Lookup
from kvconn.redaction import redact_url
from kvconn.registry import load_backend
from kvconn.tools.inspect_store import footprint
from kvconn.tools.models import Preset
from kvconn.tools.simulate.budget import available_memory, check_memory, estimate_memory
from kvconn.tools.simulate.report import StoreHolding, build_report
from kvconn.tools.simulate.timing import TimedBackend, describe_location, timed
from kvconn.tools.simulate.worker import RankSpec, rank_main
from kvconn.tools.simulate.workload import Request, WorkloadSpec, generate

START_METHODS = ("forkserver", "spawn")


class SimulationError(KvconnError):
    """A rank process failed; the message carries its traceback's last line."""


@dataclass(frozen=True)
class SimSettings:
    preset: Preset
    config: ConnectorConfig
    tp_size: int = 8
    layers: int = 2
    tokens_per_block: int = 32
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    evict_rate: float = 0.0  # chance per request of evicting one hit page after lookup
    start_method: str = "forkserver"
    salt: str = ""
    #: Ranks form a gloo group and read each shared page once per group (TP > 1).
    stripe: bool = True
    #: ``(role, rank)``: that rank computes the role differently from the ranks it
    #: should share it with (a fault for replica checks to find), or None.
    mismatch: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.preset, Preset):
            raise ConfigError(f"preset must be a model Preset, got {self.preset!r:.80}")
        if not isinstance(self.config, ConnectorConfig):
            raise ConfigError(f"config must be a ConnectorConfig, got {self.config!r:.80}")
        if not isinstance(self.workload, WorkloadSpec):
            raise ConfigError(f"workload must be a WorkloadSpec, got {self.workload!r:.80}")
        if self.start_method not in START_METHODS:
            raise ConfigError(
                f"start method {self.start_method!r}; choose one of: {', '.join(START_METHODS)}"
            )
        if (
            isinstance(self.evict_rate, bool)
            or not isinstance(self.evict_rate, (int, float))
            or not 0.0 <= self.evict_rate <= 1.0
        ):
            raise ConfigError(f"evict rate must be within [0, 1], got {self.evict_rate!r}")
        # Every rank is a process on this machine: more than real TP groups use is a typo.
        _bounded_int("--tp", self.tp_size, MAX_TP)
        _bounded_int("--tokens-per-block", self.tokens_per_block, MAX_TOKENS_PER_BLOCK)
        _bounded_int("--layers", self.layers, self.preset.layers)
        if not isinstance(self.salt, str):
            raise ConfigError(f"--salt must be a string, got {self.salt!r}")
        if not isinstance(self.stripe, bool):
            raise ConfigError(f"stripe must be a bool, got {self.stripe!r}")
        if self.mismatch is not None:
            role, rank = self.mismatch
            names = [r.name for r in self.preset.roles]
            if role not in names:
                raise ConfigError(
                    f"--inject-mismatch: {self.preset.name} has no role {role!r}; "
                    f"its roles: {', '.join(names)}"
                )
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.tp_size:
                raise ConfigError(
                    f"--inject-mismatch: rank {rank!r} is not a rank of TP={self.tp_size}"
                )


#: Largest TP group simulated: beyond real deployments (NVL72 is 72 GPUs), and each rank
#: is a process here.
MAX_TP = 128
#: Engines use 1 (SGLang) to a few hundred tokens per block.
MAX_TOKENS_PER_BLOCK = 1 << 16


def _bounded_int(flag: str, value: object, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ConfigError(f"{flag} must be an int between 1 and {high}, got {value!r}")


class Progress:
    """A one-line progress bar on a terminal; silent elsewhere (logs stay clean)."""

    def __init__(self, total: int, stream: TextIO | None, width: int = 30) -> None:
        self.total = max(1, total)
        self.stream = stream
        self.width = width
        self.start = time.perf_counter()
        self._last = 0.0

    def update(self, done: int, hit_rate: float, force: bool = False) -> None:
        if self.stream is None:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.1 and done < self.total:
            return
        self._last = now
        filled = self.width * done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(
            f"\rsimulate [{bar}] {done}/{self.total} requests  hit {hit_rate:5.1%}  "
            f"{now - self.start:6.1f}s"
        )
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()


class _Group:
    """The rank processes and their pipes."""

    def __init__(self, specs: Sequence[RankSpec], start_method: str) -> None:
        ctx: SpawnContext | ForkServerContext
        if start_method == "forkserver":
            # The server imports torch and kvconn once; each rank is then a fresh fork of
            # that clean server (never of this process, its threads or its store handles),
            # which starts 8 ranks in about a second instead of 8 torch imports.
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["kvconn.tools.simulate.worker"])
        else:
            ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[BaseProcess] = []
        try:
            for spec in specs:
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=rank_main,
                    args=(child, spec),
                    name=f"kvconn-rank{spec.rank}",
                    daemon=True,
                )
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)
            self.gather("ready")
        except BaseException:
            self.stop()
            raise

    def send(self, message: tuple[str, Any]) -> None:
        for conn in self.conns:
            conn.send(message)

    def gather(self, expected: str) -> list[Any]:
        out = []
        for rank, conn in enumerate(self.conns):
            try:
                kind, payload = conn.recv()
            except EOFError:
                self.procs[rank].join(timeout=5)
                code = self.procs[rank].exitcode
                raise SimulationError(
                    f"rank {rank} exited unexpectedly (exit code {code}); a script that "
                    'starts simulate() needs an `if __name__ == "__main__":` guard'
                    if code == 1
                    else f"rank {rank} exited unexpectedly (exit code {code})"
                ) from None
            if kind == "crash":
                payload = redact_url(str(payload))  # a traceback may quote a URL's password
                last = payload.strip().splitlines()[-1]
                sys.stderr.write(f"kvconn simulate: rank {rank} failed:\n{payload}")
                raise SimulationError(f"rank {rank} failed: {last}")
            if kind != expected:
                raise SimulationError(f"rank {rank} answered {kind!r}, expected {expected!r}")
            out.append(payload)
        return out

    def stop(self) -> None:
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)


def _num_slots(requests: Sequence[Request], tokens_per_block: int) -> int:
    """Twice the longest request's blocks, so loads land in slots other than saves."""
    longest = max((len(r.tokens) // tokens_per_block for r in requests), default=1)
    return max(4, 2 * longest)


def simulate(settings: SimSettings, progress: TextIO | None = None) -> dict[str, Any]:
    """Run the workload and return the report (see :func:`build_report`)."""
    wall_start = time.perf_counter()
    tpb = settings.tokens_per_block
    available = available_memory()
    estimate = partial(
        estimate_memory,
        ranks=settings.tp_size,
        staging_bytes=settings.config.staging_bytes,
        start_method=settings.start_method,
    )
    # Twice: with the workload's upper bound before generating it, then exactly.
    check_memory(
        estimate(pool_sizes=(), prompt_tokens=settings.workload.max_prompt_tokens()), available
    )
    requests = generate(settings.workload)
    num_slots = _num_slots(requests, tpb)
    layout = settings.preset.layout(settings.tp_size, settings.layers, num_slots, tpb)
    prompt_tokens = sum(len(r.tokens) for r in requests)
    check_memory(estimate(pool_sizes=layout.pool_sizes, prompt_tokens=prompt_tokens), available)
    config = settings.config
    # Asked once, here, before any rank starts: keys of this namespace and model must be
    # the user's to write (a Redis ACL user may be confined to other keys).
    prefix = key_prefix(config.namespace, config.model)
    backend = timed(load_backend(config.backend, config.options, key_prefix=prefix))
    # The scheduler's lookup: it follows per-rank markers, as an engine's does.
    coordinator = Lookup(config, layout, backend=backend)
    try:
        if settings.evict_rate > 0 and not backend.capabilities.delete:
            raise ConfigError(
                f"--evict-rate needs a backend that can delete; {backend.name!r} cannot"
            )
        location = describe_location(backend)
        striped = settings.stripe and settings.tp_size > 1
        workdir = tempfile.mkdtemp(prefix="kvconn-simulate-")
        specs = [
            RankSpec(
                rank,
                settings.preset,
                settings.tp_size,
                settings.layers,
                num_slots,
                tpb,
                # a group of the ranks: striped loads (and replica checks over it)
                replace(settings.config, stripe_reads=True) if striped else settings.config,
                rendezvous=os.path.join(workdir, "group") if striped else None,
                diverged=frozenset(
                    [settings.mismatch[0]]
                    if settings.mismatch is not None and settings.mismatch[1] == rank
                    else []
                ),
            )
            for rank in range(settings.tp_size)
        ]
        try:
            group = _Group(specs, settings.start_method)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        try:
            replay_start = time.perf_counter()
            coord = _replay(settings, requests, coordinator, backend, group, num_slots, progress)
            replay_s = time.perf_counter() - replay_start
            group.send(("finish", None))
            results = group.gather("result")
        finally:
            group.stop()
            shutil.rmtree(workdir, ignore_errors=True)
        held = store_holding(backend, coordinator.keys.prefix)
    finally:
        coordinator.close()
    return build_report(
        settings=settings,
        layout=layout,
        location=location,
        coordinator=coord,
        held=held,
        ranks=results,
        wall_s=time.perf_counter() - wall_start,
        startup_s=replay_start - wall_start,
        replay_s=replay_s,
        num_slots=num_slots,
    )


def store_holding(backend: Backend, prefix: str) -> StoreHolding | None:
    """What the store holds under ``prefix`` (this namespace and model), all runs together.

    A rerun of the same workload writes nothing, so what *this run* stored is 0 bytes;
    next to it the report shows what is there for the model, which is what the rerun
    hits. ``None`` when the backend cannot list its keys, or the listing failed.
    """
    if not backend.capabilities.listing:
        return None
    try:
        fp = footprint(backend.list_keys(prefix))
    except BackendError:
        return None
    return StoreHolding(
        prefix=prefix,
        pages=sum(row.pages for row in fp.rows.values()),
        bytes=sum(row.bytes for row in fp.rows.values()),
    )


def _replay(
    settings: SimSettings,
    requests: Sequence[Request],
    coordinator: Lookup,
    backend: TimedBackend,
    group: _Group,
    num_slots: int,
    progress_stream: TextIO | None,
) -> dict[str, Any]:
    tpb = settings.tokens_per_block
    scope = ReuseScope(cache_salt=settings.salt)
    rng = random.Random(f"{settings.workload.seed}/slots")
    bar = Progress(len(requests), progress_stream)
    out: dict[str, Any] = {
        "requests": 0,
        "prompt_tokens": 0,
        "hit_tokens": 0,
        "lookup_hit_tokens": 0,
        "blocks": 0,
        "blocks_computed": 0,
        "blocks_recomputed_after_failed_load": 0,
        "evictions": 0,
        "lookup_unavailable": 0,
        "time": {"store": 0.0, "planning": 0.0},
        "cpu": {"store": 0.0, "planning": 0.0},
    }
    try:
        for req in requests:
            start, start_cpu = time.perf_counter(), time.thread_time()
            hashes = block_hashes(req.tokens, tpb, scope)
            # An engine computes at least the last prompt token itself (it needs its
            # logits), so a prompt that is all full, stored blocks still recomputes one.
            cacheable = (len(req.tokens) - 1) // tpb
            backend.mark()
            store_wall, store_cpu = backend.seconds, backend.cpu_seconds
            found = coordinator.lookup(hashes[:cacheable])
            first = backend.first_call or (time.perf_counter(), time.thread_time())
            # planning: hashing the prompt and deriving the lookup keys
            out["time"]["store"] += backend.seconds - store_wall
            out["time"]["planning"] += first[0] - start
            out["cpu"]["store"] += backend.cpu_seconds - store_cpu
            out["cpu"]["planning"] += first[1] - start_cpu
            if not found.available:
                out["lookup_unavailable"] += 1
            hit = found.blocks
            if hit and settings.evict_rate and rng.random() < settings.evict_rate:
                victim = rng.randrange(hit)
                keys = coordinator.keys.block_keys(hashes[victim])
                backend.delete([rng.choice(keys)])  # as an eviction between lookup and load
                out["evictions"] += 1
            slots = rng.sample(range(num_slots), len(hashes))
            group.send(("load", (req.index, hashes, hit, slots)))
            agreed = min(group.gather("loaded"), default=0)
            group.send(("compute", agreed))
            group.gather("saved")
            out["requests"] += 1
            out["prompt_tokens"] += len(req.tokens)
            out["hit_tokens"] += agreed * tpb
            out["lookup_hit_tokens"] += hit * tpb
            out["blocks"] += len(hashes)
            out["blocks_computed"] += len(hashes) - agreed
            out["blocks_recomputed_after_failed_load"] += hit - agreed
            bar.update(out["requests"], out["hit_tokens"] / max(1, out["prompt_tokens"]))
    finally:
        bar.update(out["requests"], out["hit_tokens"] / max(1, out["prompt_tokens"]), force=True)
        bar.close()
    out["lookups"] = coordinator.stats.lookups
    out["lookup_errors"] = coordinator.stats.lookup_errors
    out["backend_errors"] = coordinator.stats.backend_errors
    return out
