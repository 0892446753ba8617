"""The simulation's figures: footprint, savings against two baselines, balance, timing.

Two baselines, both computed from the pages this run actually wrote, so they compare
schemes on the same traffic rather than on a formula:

* ``bytes_naive`` -- per-rank keying of everything (``w<tp>r<rank>`` for every page):
  every rank holding a copy of a slice would have stored its own copy, so each written
  byte of a role counts ``dup`` times (``tp`` for a replicated role).
* ``bytes_rank0_scheme`` -- the reference connector (TensorRT-LLM's Mooncake store
  connector): main KV roles (K, V, an MLA latent) keyed per rank, only roles it declares
  replicated on the side (``reference_once``, e.g. index-K) stored once by rank 0.

Reads: each rank's bytes read from the store and received from the TP group. With
striping (the default at TP > 1) a page several ranks hold leaves the store once per
group; ``bytes_read_unstriped`` is what the same loads read when every rank reads every
page it loads itself (read + received: each loaded page came one way or the other),
which is what a ``--no-stripe`` run of the same workload measures.

Byte counts by rank and role are page payloads, which is what the schemes differ in;
``bytes_stored`` adds the checksum trailer stored after each page (8 bytes with
``xxh3-64``), so it is what the store holds (``kvconn inspect``'s bytes). Savings
compare payloads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvconn.integrity import PageChecksum
from kvconn.layout import KvLayout
from kvconn.plan import plan_pages
from kvconn.tools.store_options import human_bytes

if TYPE_CHECKING:
    from kvconn.tools.simulate.runner import SimSettings

TIME_PARTS = ("store", "movement", "planning", "compute", "verify")


@dataclass(frozen=True)
class StoreHolding:
    """Page keys under one ``{namespace}/{model}/`` prefix after the run, and their bytes
    (stored values, checksum trailers included: ``kvconn inspect``'s figure)."""

    prefix: str
    pages: int
    bytes: int


def _event(stats: Mapping[str, Any], event: str, table: str = "total") -> Any:
    return stats.get(table, {}).get(event, {})


def build_report(
    *,
    settings: SimSettings,
    layout: KvLayout,
    location: str,
    coordinator: Mapping[str, Any],
    held: StoreHolding | None,
    ranks: Sequence[Mapping[str, Any]],
    wall_s: float,
    startup_s: float,
    replay_s: float,
    num_slots: int,
) -> dict[str, Any]:
    tp = settings.tp_size
    preset = settings.preset
    ranks = sorted(ranks, key=lambda r: int(r["rank"]))
    roles = [r.name for r in preset.roles]
    bytes_by_rank = [int(_event(r["stats"], "written").get("bytes", 0)) for r in ranks]
    pages_by_rank = [int(_event(r["stats"], "written").get("pages", 0)) for r in ranks]
    role_bytes = {
        role: [
            int(_event(r["stats"], "written", "by_role").get(role, {}).get("bytes", 0))
            for r in ranks
        ]
        for role in roles
    }
    role_pages = {
        role: [
            int(_event(r["stats"], "written", "by_role").get(role, {}).get("pages", 0))
            for r in ranks
        ]
        for role in roles
    }
    payload = sum(bytes_by_rank)
    checksum_bytes = PageChecksum(settings.config.checksum).size * sum(pages_by_rank)
    # Roles of page kinds a replica check split are written per rank already: each
    # rank's copy counts once (a run that split only after its first saves overstates
    # the baselines by those saves' shared pages, a small share).
    split = {k for r in ranks for k in r["stats"].get("per_rank", [])}
    per_rank_roles = {
        name for plan in plan_pages(layout) if plan.label in split for name, _ in plan.role_bytes
    }
    naive = 0
    rank0_scheme = 0
    for role in roles:
        spec = preset.role(role)
        written = sum(role_bytes[role])
        if role in per_rank_roles:
            naive += written
            rank0_scheme += written // tp if spec.reference_once else written
            continue
        naive += written * spec.dup(tp)
        rank0_scheme += written * (1 if spec.reference_once else spec.dup(tp))
    mean = payload / tp if tp else 0.0
    read_by_rank = [int(_event(r["stats"], "store_read").get("bytes", 0)) for r in ranks]
    received_by_rank = [int(_event(r["stats"], "group_received").get("bytes", 0)) for r in ranks]
    unstriped_by_rank = [a + b for a, b in zip(read_by_rank, received_by_rank)]
    times = {part: sum(float(r["time"][part]) for r in ranks) for part in TIME_PARTS}
    cpu = {part: sum(float(r["cpu"][part]) for r in ranks) for part in TIME_PARTS}
    for part in ("store", "planning"):
        times[part] += float(coordinator["time"][part])
        cpu[part] += float(coordinator["cpu"][part])
    requests = int(coordinator["requests"])
    prompt_tokens = int(coordinator["prompt_tokens"])
    examples = [e for r in ranks for e in r["examples"]]
    return {
        "model": preset.name,
        "key_model": settings.config.model,
        "tp": tp,
        # head-sharded pages cut at this many shards (w<G>r<j>), or None: at TP's own
        "shard_heads": settings.config.shard_heads,
        "layers": settings.layers,
        "model_layers": preset.layers,
        "tokens_per_block": settings.tokens_per_block,
        "backend": settings.config.backend,
        "store": location,
        "policy": settings.config.writer_policy.value,
        "striped": settings.stripe and tp > 1,
        "seed": settings.workload.seed,
        "pool_bytes_per_rank": sum(layout.pool_sizes),
        "num_slots": num_slots,
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "hit_tokens": int(coordinator["hit_tokens"]),
        "hit_rate": coordinator["hit_tokens"] / prompt_tokens if prompt_tokens else 0.0,
        "lookup_hit_tokens": int(coordinator["lookup_hit_tokens"]),
        "blocks": int(coordinator["blocks"]),
        "blocks_computed": int(coordinator["blocks_computed"]),
        "blocks_recomputed_after_failed_load": int(
            coordinator["blocks_recomputed_after_failed_load"]
        ),
        "evictions": int(coordinator["evictions"]),
        "bytes_written_by_rank": bytes_by_rank,
        "pages_written_by_rank": pages_by_rank,
        "bytes_written_by_role": {role: sum(v) for role, v in role_bytes.items()},
        "pages_written_by_role": {role: sum(v) for role, v in role_pages.items()},
        "bytes_written_by_rank_and_role": role_bytes,
        "bytes_stored": payload + checksum_bytes,
        # what the store holds for this model after the run, whichever run stored it
        "pages_in_store": None if held is None else held.pages,
        "bytes_in_store": None if held is None else held.bytes,
        "store_prefix": None if held is None else held.prefix,
        "payload_bytes_stored": payload,
        "checksum": settings.config.checksum,
        "checksum_bytes": checksum_bytes,
        "bytes_naive": naive,
        "bytes_rank0_scheme": rank0_scheme,
        # None when this run wrote nothing (a warm store): there is nothing to compare
        "saving": 1 - payload / naive if naive else None,
        "saving_rank0_scheme": 1 - rank0_scheme / naive if naive else None,
        "write_balance": max(bytes_by_rank) / mean if payload else None,
        "pages_written": sum(pages_by_rank),
        "pages_skipped": sum(int(_event(r["stats"], "skipped").get("pages", 0)) for r in ranks),
        "pages_dropped": sum(int(_event(r["stats"], "dropped").get("pages", 0)) for r in ranks),
        "pages_loaded": sum(int(_event(r["stats"], "loaded").get("pages", 0)) for r in ranks),
        "bytes_loaded": sum(int(_event(r["stats"], "loaded").get("bytes", 0)) for r in ranks),
        "bytes_read_by_rank": read_by_rank,
        "bytes_received_by_rank": received_by_rank,
        "bytes_read_unstriped_by_rank": unstriped_by_rank,
        "bytes_read": sum(read_by_rank),
        "bytes_read_unstriped": sum(unstriped_by_rank),
        # None when nothing loaded (a cold store)
        "read_saving": 1 - sum(read_by_rank) / sum(unstriped_by_rank)
        if sum(unstriped_by_rank)
        else None,
        "pages_failed": sum(int(_event(r["stats"], "failed").get("pages", 0)) for r in ranks),
        # stored pages found bad on load (checksum, wrong size) and deleted for rewriting
        "pages_corrupt": sum(int(_event(r["stats"], "corrupt").get("pages", 0)) for r in ranks),
        "pages_repaired": sum(int(_event(r["stats"], "repaired").get("pages", 0)) for r in ranks),
        "pages_verified": sum(int(r["verified"]) for r in ranks),
        # replica checks over the group: shared pages (block, kind, shard) compared across
        # the ranks holding them; every rank judges the same table, so rank 0 speaks for all
        "mismatch_injected": None
        if settings.mismatch is None
        else f"{settings.mismatch[0]}:{settings.mismatch[1]}",
        "verify_replicas_every": settings.config.verify_replicas_every,
        "replicas_verified": int(ranks[0]["stats"].get("replicas_verified", 0)) if ranks else 0,
        "replica_mismatch": int(ranks[0]["stats"].get("replica_mismatch", 0)) if ranks else 0,
        # page kinds every rank keys per rank at the end (the same on every rank)
        "per_rank_kinds": sorted(split),
        "errors": sum(int(r["errors"]) for r in ranks),
        "error_examples": examples,
        "backend_errors": int(coordinator["backend_errors"])
        + sum(int(r["stats"].get("backend_errors", 0)) for r in ranks),
        "lookup_unavailable": int(coordinator["lookup_unavailable"]),
        "wall_s": wall_s,
        "startup_s": startup_s,  # workload generation and starting the rank processes
        "replay_s": replay_s,
        "time_per_request_s": replay_s / requests if requests else 0.0,
        "time_s": times,
        "cpu_s": cpu,
    }


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def format_report(report: Mapping[str, Any]) -> str:
    """The human-readable table printed at the end of a run."""
    lines: list[str] = []
    add = lines.append
    add(
        f"kvconn simulate: {report['model']} ({report['layers']} of {report['model_layers']} "
        f"layers), TP={report['tp']}, {report['tokens_per_block']} tokens/block, "
        f"policy {report['policy']}, {report['store']}; KV pool "
        f"{human_bytes(report['pool_bytes_per_rank'])} per rank"
        + (
            f"; K/V pages cut at {report['shard_heads']} head shards (shard_heads)"
            if report.get("shard_heads")
            else ""
        )
    )
    add("")
    add(f"  requests              {report['requests']:>12,}")
    add(f"  prompt tokens         {report['prompt_tokens']:>12,}")
    add(f"  hit tokens            {report['hit_tokens']:>12,}   ({report['hit_rate']:.1%})")
    if report["blocks_recomputed_after_failed_load"]:
        add(
            f"  recomputed after a failed load {report['blocks_recomputed_after_failed_load']:,} "
            f"blocks ({report['evictions']} injected evictions)"
        )
    add(f"  pages loaded          {report['pages_loaded']:>12,}")
    if report["pages_corrupt"]:
        add(
            f"  stored pages corrupt  {report['pages_corrupt']:>12,}   "
            f"({report['pages_repaired']:,} deleted for the next save to rewrite)"
        )
    add(f"  pages verified        {report['pages_verified']:>12,}")
    add(f"  errors                {report['errors']:>12,}")
    if report["replicas_verified"] or report["replica_mismatch"] or report["mismatch_injected"]:
        injected = report["mismatch_injected"]
        add(
            f"  replica checks        {report['replicas_verified']:>12,}   shared pages equal "
            f"on every holder, {report['replica_mismatch']:,} different (the first save, then "
            f"1 block in {report['verify_replicas_every']:,})"
            + (f"; injected mismatch {injected}" if injected else "")
        )
    if report["per_rank_kinds"]:
        add(f"  keyed per rank        {', '.join(report['per_rank_kinds']):>12}")
    add("")
    roles = list(report["bytes_written_by_role"])
    header = f"  {'rank':>5} {'pages':>9} {'bytes':>12}" + "".join(f" {r:>12}" for r in roles)
    add("  written per rank (bytes by role):")
    add(header)
    by_rank_role = report["bytes_written_by_rank_and_role"]
    for rank, (pages, nbytes) in enumerate(
        zip(report["pages_written_by_rank"], report["bytes_written_by_rank"])
    ):
        cells = "".join(f" {human_bytes(by_rank_role[r][rank]):>12}" for r in roles)
        add(f"  {rank:>5} {pages:>9,} {human_bytes(nbytes):>12}{cells}")
    total_cells = "".join(f" {human_bytes(report['bytes_written_by_role'][r]):>12}" for r in roles)
    add(
        f"  {'total':>5} {report['pages_written']:>9,} "
        f"{human_bytes(report['payload_bytes_stored']):>12}{total_cells}"
    )
    page_cells = "".join(f" {report['pages_written_by_role'][r]:>12,}" for r in roles)
    add(f"  {'pages':>5} {'':>9} {'':>12}{page_cells}   (pages holding the role)")
    add("")
    if report["bytes_read_unstriped"]:
        how = "striped over a gloo group" if report["striped"] else "not striped (--no-stripe)"
        add(f"  read per rank ({how}):")
        add(f"  {'rank':>5} {'from store':>12} {'from group':>12} {'unstriped':>12}")
        for rank, (read, got, alone) in enumerate(
            zip(
                report["bytes_read_by_rank"],
                report["bytes_received_by_rank"],
                report["bytes_read_unstriped_by_rank"],
            )
        ):
            add(
                f"  {rank:>5} {human_bytes(read):>12} {human_bytes(got):>12} "
                f"{human_bytes(alone):>12}"
            )
        add(
            f"  {'total':>5} {human_bytes(report['bytes_read']):>12} "
            f"{human_bytes(sum(report['bytes_received_by_rank'])):>12} "
            f"{human_bytes(report['bytes_read_unstriped']):>12}   "
            f"store reads saved {_percent(report['read_saving'])}"
        )
        add("")
    add(
        f"  stored by this run    {human_bytes(report['bytes_stored']):>12}   "
        f"(pages {human_bytes(report['payload_bytes_stored'])}, "
        f"{report['checksum']} checksums {human_bytes(report['checksum_bytes'])})"
    )
    if report["bytes_in_store"] is None:
        add(f"  in the store          {'-':>12}   (the {report['backend']} backend cannot list)")
    else:
        add(
            f"  in the store          {human_bytes(report['bytes_in_store']):>12}   "
            f"({report['pages_in_store']:,} pages under {report['store_prefix']}, "
            "stored by this run and earlier ones)"
        )
    add(
        f"  per-rank keying       {human_bytes(report['bytes_naive']):>12}   "
        f"saving {_percent(report['saving'])}"
    )
    add(
        f"  reference scheme      {human_bytes(report['bytes_rank0_scheme']):>12}   "
        f"saving {_percent(report['saving_rank0_scheme'])}   "
        "(K/V/latent per rank, side roles once)"
    )
    balance = report["write_balance"]
    add(
        "  write balance         "
        + (f"{balance:>12.3f}" if balance is not None else f"{'-':>12}")
        + "   (max / mean bytes written per rank)"
    )
    add("")
    add(
        f"  wall time             {report['wall_s']:>11.2f}s   (start {report['startup_s']:.2f}s, "
        f"replay {report['replay_s']:.2f}s: {report['time_per_request_s'] * 1000:.1f} ms "
        "per request)"
    )
    for label, key in (("CPU time, all ranks", "cpu_s"), ("busy wall time", "time_s")):
        times = report[key]
        total = sum(times.values()) or 1.0
        split = ", ".join(
            f"{part} {seconds:.2f}s ({seconds / total:.0%})" for part, seconds in times.items()
        )
        add(f"  {label:<21} {split}")
    if report["pages_dropped"] or report["backend_errors"]:
        add(
            f"  backend errors {report['backend_errors']}, pages dropped "
            f"{report['pages_dropped']} (the store could not be reached)"
        )
    if report["errors"]:
        add("")
        add(f"  {report['errors']} loaded page(s) differ from recomputation; first examples:")
        for example in report["error_examples"]:
            add(f"    {example}")
    return "\n".join(lines)
