"""SGLang's HiCache host pool described as a kvconn layout.

A kvconn block is one SGLang page (``page_size`` tokens) and its slot is the page's
index in the host pool, so a page moves between the store and the host pool in place.
Regions are declared in the order of SGLang's own flat page (``get_data_page``), so a
stored page holds the same bytes SGLang's file backend would write for that layout.

The host layout is part of each role's dtype, hence of every key: ``page_first`` and
``page_first_direct`` pages have the same size but another byte order, and a reader in
one layout must miss pages written in the other, never reinterpret them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvconn.errors import LayoutError
from kvconn.layout import KvLayout, LayerGroup, Region, Role

#: Host layouts whose buffer is ``[component, page, …]``-major or per layer: every page
#: of a region is a contiguous byte range at a constant stride.
LAYER_FIRST = "layer_first"
PAGE_MAJOR = ("page_first", "page_first_direct", "page_head")
SUPPORTED_LAYOUTS = (LAYER_FIRST, *PAGE_MAJOR)


@dataclass(frozen=True)
class HostPoolShape:
    """What the adapter reads off a host pool (duck-typed, so tests need no SGLang).

    ``kind`` is ``"mha"`` (``kv_buffer`` holds K and V on dim 0) or ``"mla"`` (one
    latent per token, identical on every rank).
    """

    kind: str
    layout: str
    page_size: int
    layer_num: int
    size: int  # tokens, a multiple of page_size
    kv_buffer: torch.Tensor
    head_num: int = 1  # KV heads on this rank (MHA)


def kv_units(head_num: int, tp_size: int, kv_heads: int | None) -> int:
    """The role's ``units`` (global KV heads), checked against this rank's share.

    SGLang gives each rank ``kv_heads / tp`` heads, or with fewer heads than ranks one
    head duplicated on ``tp / kv_heads`` consecutive ranks — kvconn's own shard rule.
    """
    if kv_heads is None:
        return head_num * tp_size
    if kv_heads >= tp_size:
        if kv_heads != head_num * tp_size:
            raise LayoutError(
                f"kv_heads={kv_heads} at TP={tp_size} puts {kv_heads / tp_size:g} heads on "
                f"each rank, but SGLang's host pool holds {head_num}"
            )
    elif head_num != 1 or tp_size % kv_heads != 0:
        raise LayoutError(
            f"kv_heads={kv_heads} at TP={tp_size}: SGLang duplicates one head on "
            f"{tp_size // max(kv_heads, 1)} ranks, but this host pool holds {head_num} heads "
            "(or TP is not a multiple of kv_heads)"
        )
    return kv_heads


def describe_host_pool(shape: HostPoolShape, tp_size: int, units: int) -> KvLayout:
    """The kvconn layout of one rank's host pool; ``units`` is the K/V role's (MHA)."""
    if shape.layout not in SUPPORTED_LAYOUTS:
        raise LayoutError(
            f"HiCache host layout {shape.layout!r} is not supported by kvconn; use one of "
            f"{', '.join(SUPPORTED_LAYOUTS)}"
        )
    if shape.size % shape.page_size != 0:
        raise LayoutError(
            f"host pool of {shape.size} tokens is not a whole number of "
            f"{shape.page_size}-token pages"
        )
    pages = shape.size // shape.page_size
    buffer = shape.kv_buffer
    dtype = f"{str(buffer.dtype).removeprefix('torch.')}:{shape.layout}"
    roles: tuple[Role, ...]
    if shape.kind == "mha":
        roles = (Role("k", units, dtype), Role("v", units, dtype))
        components = [("k", buffer[0]), ("v", buffer[1])]
    elif shape.kind == "mla":
        roles = (Role("latent", 1, dtype),)
        components = [("latent", buffer)]
    else:
        raise LayoutError(f"unknown host pool kind {shape.kind!r}")
    regions: list[Region] = []
    for role, tensor in components:
        if shape.layout == LAYER_FIRST:
            # [layer, token, …]: one region per layer, a page is page_size token rows
            if tensor.shape[0] != shape.layer_num:
                raise LayoutError(
                    f"{role}: layer_first buffer has {tensor.shape[0]} layers, "
                    f"the host pool says {shape.layer_num}"
                )
            for layer in range(shape.layer_num):
                view = tensor[layer].reshape(pages, -1)
                regions.append(Region.from_tensor(role, layer, view, buffer))
        else:
            # [page or token, …]: a whole page of every layer is one contiguous range
            regions.append(Region.from_tensor(role, 0, tensor.reshape(pages, -1), buffer))
    group = LayerGroup(0, pages, tuple(regions), name=f"hicache {shape.layout}")
    return KvLayout(
        tp_size=tp_size,
        tokens_per_block=shape.page_size,
        roles=roles,
        groups=(group,),
        pool_sizes=(buffer.numel() * buffer.element_size(),),
    )


def page_slots(host_indices: torch.Tensor, page_size: int, n_pages: int) -> torch.Tensor:
    """Page indices of the ``n_pages`` pages whose token indices SGLang passed.

    SGLang passes ``page_size`` token indices per page; the host pool allocates whole
    pages, so each page's first index is page-aligned and the rest follow it.
    """
    if host_indices.numel() != n_pages * page_size:
        raise LayoutError(
            f"{host_indices.numel()} host indices for {n_pages} pages of {page_size} tokens"
        )
    firsts = host_indices.reshape(n_pages, page_size)[:, 0].to(torch.long)
    if bool((firsts % page_size).any()):
        raise LayoutError(
            f"host indices are not page-aligned (page size {page_size}): {firsts[:8].tolist()}"
        )
    return firsts // page_size
