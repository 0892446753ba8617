"""Layouts of real models, as the engines lay out their KV pools.

Used by ``kvconn simulate``, the tests and the benchmarks, so the figures they report
(bytes stored, savings) come from real geometry rather than toy shapes.

A :class:`Preset` describes a model *independently of TP*: each role says how many
distinct slices (``units``) exist across the group and how many bytes one slice takes
per token. :meth:`Preset.layout` turns that into one rank's :class:`KvLayout` at a given
TP size, so the same preset gives the per-rank geometry at TP=1, 4 or 8.

Pool placement follows TensorRT-LLM's block-major pools: one pool slot holds one block
of tokens for *every* layer, layer after layer, and inside a layer the roles that share
the pool follow each other (K, V, then MiniMax-M3's index-K). So in ``minimax-m3`` the
sharded K/V bytes and the replicated index-K bytes interleave inside every slot, the
hardest case for page assembly. DeepSeek-V3.2's indexer K lives in a pool of its own
(the indexer cache is a separate allocation in both TensorRT-LLM and vLLM), so its
latent and indexer pages come from two pools.

Custom layouts come from a TOML file (:func:`load_preset`)::

    name = "my-model"       # the model segment of keys unless --config sets `model`
    layers = 32
    sources = ["where the numbers come from"]   # optional

    [[roles]]
    name = "k"              # lower-case letters, digits, '_'
    units = 8               # distinct slices across the TP group (KV heads); 1 = replicated
    bytes_per_unit = 256    # bytes per token of one slice (head_dim x element size)
    dtype = "bf16"          # goes into every key: a reader with another dtype misses
    pool = 0                # optional, default 0; roles of one pool interleave per layer
    reference = "per_rank"  # optional: "per_rank" (default) or "once" -- how the
                            # reference connector keys the role (see Preset docstring)
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvconn.config import load_toml, unknown_names
from kvconn.errors import ConfigError, LayoutError
from kvconn.layout import KvLayout, LayerGroup, Region, Role, UnitLayout, shard_position


@dataclass(frozen=True)
class RoleSpec:
    """A role's bytes per token *on one rank*, and its global unit count."""

    name: str
    bytes_per_token: int
    units: int
    dtype: str


def interleaved_layout(
    roles: Sequence[RoleSpec],
    *,
    tp_size: int,
    layers: int,
    num_slots: int,
    tokens_per_block: int = 32,
) -> KvLayout:
    """One pool; each slot holds, layer after layer, every role's bytes for one block.

    This is the hardest case for page assembly (sharded and replicated bytes interleave
    within a slot) and the layout TensorRT-LLM uses for MiniMax-M3's index-K.
    """
    per_layer = sum(r.bytes_per_token for r in roles) * tokens_per_block
    stride = per_layer * layers
    regions = []
    for layer in range(layers):
        offset = layer * per_layer
        for role in roles:
            size = role.bytes_per_token * tokens_per_block
            regions.append(Region(role.name, layer, offset, size, stride, num_slots))
            offset += size
    return KvLayout(
        tp_size=tp_size,
        tokens_per_block=tokens_per_block,
        roles=tuple(Role(r.name, r.units, r.dtype) for r in roles),
        groups=(LayerGroup(0, num_slots, tuple(regions)),),
        pool_sizes=(stride * num_slots,),
    )


#: Bounds of custom layouts, far above any real model (a KV head is a few hundred bytes
#: per token, models have a few hundred layers): beyond them a file holds a typo.
MAX_UNITS = 1 << 16
MAX_BYTES_PER_UNIT = 1 << 20
MAX_POOLS = 64
MAX_LAYERS = 10_000


def _bounded(where: str, what: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise LayoutError(f"{where}: {what} must be an int between {low} and {high}, got {value!r}")


@dataclass(frozen=True)
class PresetRole:
    """One role of a model, described independently of the TP size.

    ``units`` is the number of distinct slices across the whole TP group (global KV
    heads; 1 for bytes every rank holds identically) and ``bytes_per_unit`` the bytes
    one slice takes per token. A rank at TP ``tp`` holds ``units // min(tp, units)``
    slices: with fewer heads than ranks each rank holds one head, duplicated.

    ``reference_once`` marks a *side* role that the reference connector (TensorRT-LLM's
    Mooncake store connector) already declares replicated and stores once, written by
    rank 0 -- e.g. an index-K. Main KV roles (K, V, an MLA latent) are keyed per rank
    there even when their bytes are identical; that is the difference kvconn measures.
    """

    name: str
    units: int
    bytes_per_unit: int
    dtype: str
    pool: int = 0
    reference_once: bool = False

    def __post_init__(self) -> None:
        Role(self.name, self.units, self.dtype)  # same name/units/dtype rules as the core
        where = f"role {self.name!r}"
        _bounded(where, "units", self.units, 1, MAX_UNITS)
        _bounded(where, "bytes_per_unit", self.bytes_per_unit, 1, MAX_BYTES_PER_UNIT)
        _bounded(where, "pool", self.pool, 0, MAX_POOLS - 1)
        if not isinstance(self.reference_once, bool):
            raise LayoutError(f"{where}: reference_once must be a bool")
        if self.reference_once and self.units != 1:
            raise LayoutError(
                f"{where}: reference 'once' applies only to replicated roles (units = 1), "
                f"not to one with units = {self.units}"
            )

    @property
    def replicated(self) -> bool:
        return self.units == 1

    def bytes_per_token(self, tp_size: int) -> int:
        """Bytes per token of this role on one rank at ``tp_size``."""
        pos = shard_position(0, tp_size, self.units)  # raises on inconsistent units
        return self.bytes_per_unit * (self.units // pos.num_shards)

    def dup(self, tp_size: int) -> int:
        """How many ranks hold identical copies of each slice at ``tp_size``."""
        return shard_position(0, tp_size, self.units).dup


@dataclass(frozen=True)
class Preset:
    """A model's KV geometry: roles, real layer count and where the numbers come from."""

    name: str
    roles: tuple[PresetRole, ...]
    layers: int
    sources: tuple[str, ...] = ()
    summary: str = ""
    _by_name: dict[str, PresetRole] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise LayoutError(f"a model preset needs a non-empty name, got {self.name!r}")
        where = f"model {self.name!r}"
        for name in ("roles", "sources"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)):
                raise LayoutError(f"{where}: {name} must be a tuple or list, got {value!r:.80}")
            object.__setattr__(self, name, tuple(value))
        _bounded(where, "layers", self.layers, 1, MAX_LAYERS)
        if not isinstance(self.summary, str):
            raise LayoutError(f"{where}: summary must be a string, got {self.summary!r}")
        if not self.roles:
            raise LayoutError(f"{where}: has no roles")
        by_name: dict[str, PresetRole] = {}
        for role in self.roles:
            if not isinstance(role, PresetRole):
                raise LayoutError(f"{where}: {role!r} is not a PresetRole")
            if role.name in by_name:
                raise LayoutError(f"{where}: role {role.name!r} is declared twice")
            by_name[role.name] = role
        pools = sorted({r.pool for r in self.roles})
        if pools != list(range(len(pools))):
            raise LayoutError(
                f"{where}: pools must be numbered 0, 1, ... without gaps, got {pools}"
            )
        object.__setattr__(self, "_by_name", by_name)

    def role(self, name: str) -> PresetRole:
        return self._by_name[name]

    def role_specs(self, tp_size: int) -> tuple[RoleSpec, ...]:
        """Per-rank bytes of every role at ``tp_size`` (raises on inconsistent units)."""
        return tuple(
            RoleSpec(r.name, self._per_rank_bytes(r, tp_size), r.units, r.dtype) for r in self.roles
        )

    def _per_rank_bytes(self, role: PresetRole, tp_size: int) -> int:
        try:
            return role.bytes_per_token(tp_size)
        except LayoutError as exc:
            raise LayoutError(
                f"model {self.name!r} cannot run at TP={tp_size}: role {role.name!r} has "
                f"{role.units} units (KV heads): {exc}"
            ) from None

    def resolve_layers(self, layers: int | None) -> int:
        """``layers`` checked against the model (``None``: the real count)."""
        if layers is None:
            return self.layers
        valid = isinstance(layers, int) and not isinstance(layers, bool)
        if not valid or not 1 <= layers <= self.layers:
            raise ConfigError(
                f"model {self.name!r} has {self.layers} layers; --layers must be "
                f"between 1 and {self.layers}, got {layers!r}"
            )
        return layers

    def layout(
        self,
        tp_size: int = 8,
        layers: int | None = None,
        num_slots: int = 64,
        tokens_per_block: int = 32,
    ) -> KvLayout:
        """One rank's pool layout at ``tp_size``, with the first ``layers`` layers.

        One layer group (every layer shares the block table). Each pool's slot holds one
        block for every layer, layer after layer; inside a layer the pool's roles follow
        each other in declared order. Regions are declared pool by pool, then layer by
        layer, so that the page mover can fold a role's layers into one strided run.
        Inside a region, a sharded role's heads follow each other, each head's tokens
        contiguous (TensorRT-LLM's ``[heads, tokens, head bytes]``): its unit layout,
        which pages cut at ``shard_heads`` need.
        """
        n_layers = self.resolve_layers(layers)
        for what, value in (("tokens_per_block", tokens_per_block), ("num_slots", num_slots)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{what} must be an int >= 1, got {value!r}")
        per_token = {r.name: self._per_rank_bytes(r, tp_size) for r in self.roles}
        n_pools = 1 + max(r.pool for r in self.roles)
        regions: list[Region] = []
        pool_sizes: list[int] = []
        for pool in range(n_pools):
            members = [r for r in self.roles if r.pool == pool]
            per_layer = sum(per_token[r.name] for r in members) * tokens_per_block
            stride = per_layer * n_layers
            for layer in range(n_layers):
                offset = layer * per_layer
                for role in members:
                    size = per_token[role.name] * tokens_per_block
                    units = None
                    if not role.replicated:
                        inner = role.bytes_per_unit * tokens_per_block
                        units = UnitLayout(size // inner, inner)
                    regions.append(
                        Region(role.name, layer, offset, size, stride, num_slots, pool, units)
                    )
                    offset += size
            pool_sizes.append(stride * num_slots)
        return KvLayout(
            tp_size=tp_size,
            tokens_per_block=tokens_per_block,
            roles=tuple(Role(r.name, r.units, r.dtype) for r in self.roles),
            groups=(LayerGroup(0, num_slots, tuple(regions), name=self.name),),
            pool_sizes=tuple(pool_sizes),
        )


MINIMAX_M3_PRESET = Preset(
    name="minimax-m3",
    layers=60,
    roles=(
        PresetRole("k", units=8, bytes_per_unit=256, dtype="bf16"),
        PresetRole("v", units=8, bytes_per_unit=256, dtype="bf16"),
        PresetRole("index_k", units=1, bytes_per_unit=256, dtype="bf16", reference_once=True),
    ),
    summary="K/V sharded by KV head, sparse-attention index-K replicated, all in one slot",
    sources=(
        "K, V: 8 KV heads x head_dim 128 x bf16 (2 B) = 256 B/token per head, one head per "
        "rank at TP=8 (DESIGN.md).",
        "index-K: the sparse-attention indexer key, 128 dims x bf16 = 256 B/token, computed "
        "from a replicated projection, hence identical on every rank (DESIGN.md); modelled "
        "on every layer.",
        "60 layers: num_hidden_layers of MiniMax-M3-preview (transformers MiniMaxM3VLTextConfig).",
        "Caveat: public MiniMax-M3-preview configs list num_key_value_heads = 4 and dense "
        "attention (no index-K) on layers 0-2; this preset follows DESIGN.md's geometry, "
        "see docs/simulate.md.",
    ),
)

DEEPSEEK_V32_PRESET = Preset(
    name="deepseek-v3.2",
    layers=61,
    roles=(
        PresetRole("latent", units=1, bytes_per_unit=656, dtype="fp8e4m3+f32scale+bf16rope"),
        PresetRole(
            "index_k",
            units=1,
            bytes_per_unit=132,
            dtype="fp8e4m3+f32scale",
            pool=1,
            reference_once=True,
        ),
    ),
    summary="MLA latent and indexer K, both replicated; the indexer in its own pool",
    sources=(
        "MLA latent: kv_lora_rank 512 + qk_rope_head_dim 64 = 576 elements per token, one "
        "latent shared by all heads, so every rank holds all of it. Stored in the FP8 "
        "sparse-MLA cache format as 656 B/token: 512 B fp8 e4m3 (the 512 NoPE elements) "
        "+ 16 B (4 fp32 scales, one per 128-element tile) + 128 B (64 RoPE elements in "
        "bf16).",
        "Indexer K: index_head_dim 128 in fp8 (128 B) + one fp32 scale (4 B) = 132 B/token, "
        "computed from replicated weights, identical on every rank.",
        "61 layers: num_hidden_layers of DeepSeek-V3.2(-Exp) config.json; every layer "
        "has MLA and the indexer.",
    ),
)

QWEN3_235B_PRESET = Preset(
    name="qwen3-235b-a22b",
    layers=94,
    roles=(
        PresetRole("k", units=4, bytes_per_unit=256, dtype="bf16"),
        PresetRole("v", units=4, bytes_per_unit=256, dtype="bf16"),
    ),
    summary="GQA with 4 KV heads: at TP=8 each head lives on 2 ranks (partial replication)",
    sources=(
        "K, V: num_key_value_heads 4 x head_dim 128 x bf16 = 256 B/token per head "
        "(Qwen3-235B-A22B config.json); at TP=8 each head sits on 2 consecutive ranks.",
        "94 layers: num_hidden_layers of Qwen3-235B-A22B config.json.",
    ),
)

LLAMA_31_70B_PRESET = Preset(
    name="llama-3.1-70b",
    layers=80,
    roles=(
        PresetRole("k", units=8, bytes_per_unit=256, dtype="bf16"),
        PresetRole("v", units=8, bytes_per_unit=256, dtype="bf16"),
    ),
    summary="GQA with 8 KV heads: one head per rank at TP=8, nothing replicated",
    sources=(
        "K, V: num_key_value_heads 8 x head_dim 128 x bf16 = 256 B/token per head "
        "(Llama-3.1-70B config.json).",
        "80 layers: num_hidden_layers of Llama-3.1-70B config.json.",
    ),
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (MINIMAX_M3_PRESET, DEEPSEEK_V32_PRESET, QWEN3_235B_PRESET, LLAMA_31_70B_PRESET)
}


def get_preset(name: str) -> Preset:
    """The preset called ``name``; an unknown name lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model preset {name!r}; presets: {', '.join(sorted(PRESETS))} "
            "(or a custom layout: --layout FILE.toml)"
        ) from None


_FILE_KEYS = {"name", "layers", "sources", "summary", "roles"}
_ROLE_KEYS = {"name", "units", "bytes_per_unit", "dtype", "pool", "reference"}


def preset_from_dict(data: Mapping[str, Any], where: str = "layout") -> Preset:
    """Build a preset from the TOML table format described in the module docstring.

    Unknown keys are errors, like everywhere in kvconn's configuration: a misspelt
    ``bytes_per_unt`` must not silently produce a different footprint.
    """
    if set(data) - _FILE_KEYS:
        raise unknown_names("key", set(data) - _FILE_KEYS, _FILE_KEYS, where=where)
    for required in ("name", "layers", "roles"):
        if required not in data:
            raise ConfigError(f"{where}: missing {required!r}")
    raw_roles = data["roles"]
    if not isinstance(raw_roles, list) or not raw_roles:
        raise ConfigError(f"{where}: 'roles' must be a non-empty array of tables ([[roles]])")
    roles = []
    for i, raw in enumerate(raw_roles):
        here = f"{where}: roles[{i}]"
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{here} must be a table")
        if set(raw) - _ROLE_KEYS:
            raise unknown_names("key", set(raw) - _ROLE_KEYS, _ROLE_KEYS, where=here)
        missing = [k for k in ("name", "units", "bytes_per_unit", "dtype") if k not in raw]
        if missing:
            raise ConfigError(f"{here}: missing {', '.join(missing)}")
        reference = raw.get("reference", "per_rank")
        if reference not in ("per_rank", "once"):
            raise ConfigError(f"{here}: reference must be 'per_rank' or 'once', got {reference!r}")
        try:
            roles.append(
                PresetRole(
                    name=raw["name"],
                    units=raw["units"],
                    bytes_per_unit=raw["bytes_per_unit"],
                    dtype=raw["dtype"],
                    pool=raw.get("pool", 0),
                    reference_once=reference == "once",
                )
            )
        except LayoutError as exc:
            raise LayoutError(f"{here}: {exc}") from None
    sources = data.get("sources", ())
    if isinstance(sources, str):
        sources = (sources,)
    if not isinstance(sources, (list, tuple)) or not all(isinstance(s, str) for s in sources):
        raise ConfigError(f"{where}: 'sources' must be a string or an array of strings")
    try:
        return Preset(
            name=data["name"],
            layers=data["layers"],
            roles=tuple(roles),
            sources=tuple(sources),
            summary=str(data.get("summary", "custom layout")),
        )
    except LayoutError as exc:
        raise LayoutError(f"{where}: {exc}") from None


def load_preset(path: str | os.PathLike[str]) -> Preset:
    """A custom layout from a TOML file (format in the module docstring)."""
    return preset_from_dict(load_toml(path, "layout file"), where=f"layout file {Path(path)}")


def minimax_m3(tp_size: int = 8, layers: int = 4, num_slots: int = 64) -> KvLayout:
    """MiniMax-M3: 8 KV heads x 128 bf16 for K and V; a replicated index-K."""
    return MINIMAX_M3_PRESET.layout(tp_size, layers, num_slots)
