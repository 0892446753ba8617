"""A kvconn layout from vLLM's per-layer KV cache tensors.

vLLM hands a connector ``{layer name: tensor}``. Two tensor forms occur:

* blocks first, ``[num_blocks, ...]`` (the CPU backends: ``[blocks, heads, block_size,
  2 * head_size]``, each head's K rows then its V rows; MLA ``[blocks, 1, block_size,
  576]``): one region per layer;
* K/V first, ``[2, num_blocks, ...]`` (FlashAttention-style backends): two regions per
  layer, roles ``k`` and ``v``.

Either way a block's bytes of one layer are contiguous, which is all a page needs.

What a layer's bytes are, and how they split across TP ranks, comes from vLLM's
KV-cache spec objects (``kvconn_vllm.specs``, the only module here that reads vLLM),
handed to this module as plain :class:`CacheGroup` data:

* K/V by head (role ``kv``): ``units`` is the model's total KV head count, so heads
  that vLLM duplicates across TP ranks (fewer KV heads than ranks) are stored once, and
  with one KV head the whole cache is replicated;
* an MLA latent (role ``latent``) and DeepSeek-V3.2's indexer keys (``index_k``) are
  the same bytes on every rank: ``units`` 1, one ``replicated`` page per block.

Each vLLM KV-cache group becomes a kvconn layer group with the same index, so vLLM's
per-group block ids are the group's slots; a sliding-window group carries its window
in blocks. A Mamba layer's state arrives as its raw bytes per block, ``[num_blocks, 1,
1, state bytes]`` (``int8``, each block's row padded to vLLM's page size): one ``mamba``
region per layer, in a group of window 1. vLLM's hybrid allocator lays every group over
the same buffer (a block id belongs to one group at a time), so each group's regions
refer to a pool index of its own, over that same memory: kvconn checks regions for
overlap within a pool, which still catches a wrong description inside a group.

The arrangement of bytes inside a block differs between attention backends, so a
role's dtype names the element type, the backend and the block's shape: two backends
that lay a block out differently never share pages. Layers whose tensor is the same
memory as an earlier layer's of the same group (vLLM's KV sharing) add no region: their
bytes are that layer's.

Pages shared across TP sizes (kvconn's ``shard_heads``): vLLM 0.32 hands every
attention layer's cache as its logical ``[blocks, heads, block_size, content]``
(``[B, H, N, C]``), and the CPU backend lays it out in that order (``LBHNC``), so each
head's bytes of a block are contiguous. A blocks-first ``kv`` region then carries its
unit layout (one unit per local head, ``outer = 1``), which lets kvconn cut it into head
shards; and with ``shard_heads`` set the dtype names the block shape with all the
model's heads instead of this rank's, so every TP size names the pages alike. K/V-first
tensors (an older form, whose head dimension is not placed the same way) carry none:
pages cut finer than a rank's own heads are then refused with a clear error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvconn.errors import LayoutError
from kvconn.layout import Chunked, KvLayout, LayerGroup, Region, Role, Window

_NUMBER = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


@dataclass(frozen=True)
class LayerBytes:
    """What one layer's cache holds, as kvconn keys it.

    ``role``: ``kv`` (K and V by head; split into ``k`` and ``v`` for K/V-first
    tensors), ``latent`` (MLA), ``index_k`` (DeepSeek-V3.2's indexer) or ``mamba`` (a
    recurrent state). ``units``: distinct slices across the TP group (total KV heads, 1
    for bytes every rank holds, the TP size for a state each rank holds a slice of).
    ``tag``: what an element is, where the tensor's dtype does not say it (a Mamba
    state arrives as raw bytes); ``None``: the dtype tag the layout is given.
    ``units`` of a draft layer count the draft model's heads.
    """

    role: str
    units: int
    tag: str | None = None
    #: A speculative-decoding draft model's layer: its roles are ``draft_<role>``, a
    #: kind of bytes of their own (the draft's head count and geometry are its own).
    draft: bool = False
    #: The draft's weights (``EngineModel.tag``), named in its roles' dtype: a draft
    #: of the same shape and other weights computes other bytes, whose pages must not
    #: be loaded for it (its drafts would silently be accepted less often).
    weights: str | None = None

    def named(self, role: str) -> str:
        """The layout's name for ``role`` (``kv``, ``k``, ``latent`` …) of this layer."""
        return f"draft_{role}" if self.draft else role


@dataclass(frozen=True)
class CacheGroup:
    """One vLLM KV-cache group: its layers in vLLM's order, its window (blocks of a
    sliding window, 1 for a Mamba state, :class:`~kvconn.layout.Chunked` for chunked
    local attention; ``None`` for full attention), and its kind (``attention`` or
    ``mamba``)."""

    index: int
    layers: tuple[tuple[str, LayerBytes], ...]
    window: Window = None
    kind: str = "attention"


def layer_index(name: str, position: int) -> int:
    """The layer number in a vLLM layer name (``model.layers.7.self_attn.attn`` → 7).

    Names with no number, or several, fall back to the layer's position, which is
    stable for one model.
    """
    numbers = _NUMBER.findall(name)
    return int(numbers[0]) if len(numbers) == 1 else position


def layer_numbers(names: Sequence[str]) -> dict[str, int]:
    """A layer number for each vLLM layer name, from ``names`` in vLLM's order (the
    same in every process).

    Each name's own number (:func:`layer_index`; layers of one number and several roles,
    like an attention layer and its indexer, share it). A draft model's layers
    (speculative decoding, ``draft_model.model.layers.0.self_attn.attn``) number from
    0 again under a prefix of their own: where two prefixes' numbers meet, each
    prefix's layers continue past the numbers of the prefixes before it, in order of
    first appearance (the target's keep theirs), and names with no single number come
    last.
    """
    plain = {name: layer_index(name, i) for i, name in enumerate(names)}
    stacks: dict[str, list[tuple[str, int]]] = {}  # prefix -> (name, its number)
    for name in names:
        found = list(_NUMBER.finditer(name))
        if len(found) == 1:
            stacks.setdefault(name[: found[0].start(1)], []).append((name, int(found[0][1])))
    taken: set[int] = set()
    for members in stacks.values():
        numbers = {n for _, n in members}
        if numbers & taken:
            break
        taken |= numbers
    else:
        return plain  # no two prefixes share a number
    out: dict[str, int] = {}
    for members in stacks.values():
        base = max(out.values(), default=-1) + 1
        out.update((name, base + n) for name, n in members)
    for name in names:
        if name not in out:
            out[name] = max(out.values(), default=-1) + 1
    return {name: out[name] for name in names}


def storage_pool(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage ``tensor`` lives in.

    Regions are described relative to it, so a permuted or sliced view vLLM hands out
    still maps to plain byte offsets, and layers that share one allocation share a pool.
    """
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def kv_layout(
    kv_caches: Mapping[str, torch.Tensor],
    groups: Sequence[CacheGroup],
    *,
    num_blocks: int,
    block_size: int,
    tp_size: int,
    dtype_tags: Mapping[str, str],
    shard_heads: int | None = None,
) -> tuple[KvLayout, list[torch.Tensor]]:
    """The layout of one rank's KV caches, and the pool tensors it refers to.

    ``dtype_tags`` says, per layer, what an element is and who arranged the block (e.g.
    ``bfloat16+CPU_ATTN``); the block's shape is appended to it in each role's dtype:
    this rank's, or with ``shard_heads`` (kvconn's setting) the model's, all its heads.
    """
    if not kv_caches:
        raise LayoutError("vLLM registered no KV cache tensors")
    if not groups:
        raise LayoutError("vLLM's KV cache config has no group kvconn can store")
    numbers = layer_numbers(list(kv_caches))
    pools: list[torch.Tensor] = []
    pool_of: dict[tuple[int, int], int] = {}  # (group, storage address) -> pool index
    roles: dict[str, tuple[int, str]] = {}  # role -> (units, dtype)
    layer_groups: list[LayerGroup] = []
    for group in groups:
        seen: set[tuple[int, tuple[int, ...]]] = set()
        regions: list[Region] = []
        for name, what in group.layers:
            tensor = kv_caches.get(name)
            if tensor is None:
                raise LayoutError(
                    f"vLLM layer {name!r} of KV cache group {group.index} has no tensor"
                )
            ident = (tensor.data_ptr(), tuple(tensor.shape))
            if ident in seen:
                continue  # KV sharing: this layer reads another layer's cache
            seen.add(ident)
            views = [(what.named(r), v) for r, v in _views(name, tensor, num_blocks, what.role)]
            by_head = _heads_dim(tensor, num_blocks, what, tp_size)
            for role, view in views:
                dims = list(view.shape[1:])
                if by_head and shard_heads is not None:
                    dims[0] = what.units  # every TP size names the block alike
                shape = "x".join(str(d) for d in dims)
                element = what.tag or dtype_tags[name]
                if what.weights:
                    element = f"{element}+draft={what.weights}"
                dtype = f"{element}+{shape}"
                known = roles.setdefault(role, (what.units, dtype))
                if known != (what.units, dtype):
                    raise LayoutError(
                        f"vLLM layer {name!r}: its {role!r} bytes are {dtype} in {what.units} "
                        f"units, other layers' are {known[1]} in {known[0]}; layers of one "
                        "role must share a geometry"
                    )
            address = tensor.untyped_storage().data_ptr()
            if (group.index, address) not in pool_of:
                pool_of[(group.index, address)] = len(pools)
                pools.append(storage_pool(tensor))
            pool = pool_of[(group.index, address)]
            layer = numbers[name]
            unit_dim = 1 if by_head else None
            regions.extend(
                Region.from_tensor(role, layer, view, pools[pool], pool, unit_dim)
                for role, view in views
            )
        layer_groups.append(
            LayerGroup(group.index, num_blocks, tuple(regions), _group_name(group), group.window)
        )
    layout = KvLayout(
        tp_size=tp_size,
        tokens_per_block=block_size,
        roles=tuple(Role(name, units, dtype) for name, (units, dtype) in roles.items()),
        groups=tuple(layer_groups),
        pool_sizes=tuple(p.numel() for p in pools),
    )
    return layout, pools


def _heads_dim(tensor: torch.Tensor, num_blocks: int, what: LayerBytes, tp_size: int) -> bool:
    """Whether dim 1 of a blocks-first ``kv`` tensor holds this rank's KV heads.

    vLLM 0.32's logical ``[B, H, N, C]``: a ``kv`` layer with as many entries there as
    the rank holds heads. Anything else (K/V first, another role, another count) gets
    no unit layout: its pages are still stored, only not cut finer than the rank's heads.
    """
    blocks_first, kv_first = _forms(tensor, num_blocks)
    if what.role != "kv" or not blocks_first or kv_first or tensor.dim() < 3:
        return False
    local = what.units // min(tp_size, what.units)
    return int(tensor.shape[1]) == local


def _group_name(group: CacheGroup) -> str:
    if group.kind != "attention" or group.window is None:
        return group.kind
    if isinstance(group.window, Chunked):
        return f"chunked{group.window.blocks}"
    return f"sliding{group.window}"


def _views(
    name: str, tensor: torch.Tensor, num_blocks: int, role: str
) -> list[tuple[str, torch.Tensor]]:
    """The tensor's per-role views with blocks along dim 0."""
    blocks_first, kv_first = _forms(tensor, num_blocks)
    if blocks_first == kv_first:
        raise LayoutError(
            f"vLLM layer {name!r}: KV tensor of shape {tuple(tensor.shape)} is "
            f"{'ambiguous' if blocks_first else 'neither'} [num_blocks={num_blocks}, ...] "
            f"{'and' if blocks_first else 'nor'} [2, num_blocks, ...]"
        )
    if not kv_first:
        return [(role, tensor)]
    if role != "kv":
        raise LayoutError(f"vLLM layer {name!r}: a {role!r} cache in K/V-first form")
    return [("k", tensor[0]), ("v", tensor[1])]


def _forms(tensor: torch.Tensor, num_blocks: int) -> tuple[bool, bool]:
    """Whether ``tensor`` reads as blocks first, and whether as K/V first."""
    shape = tuple(tensor.shape)
    blocks_first = len(shape) >= 2 and shape[0] == num_blocks
    kv_first = len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks
    return blocks_first, kv_first
