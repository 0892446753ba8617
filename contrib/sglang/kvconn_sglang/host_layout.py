"""SGLang's HiCache host pools described as a kvconn layout.

A kvconn block is one SGLang page (``page_size`` tokens) and its slot is the page's
index in the host pool, so a page moves between the store and the host pool in place.
Regions are declared in the order of SGLang's own flat page (``get_data_page``), so a
stored page holds the same bytes SGLang's file backend would write for that layout.

Each host pool is a layer group of its own, over a pool tensor of its own: the KV pool
(the anchor) is group 0, and each side pool SGLang moves through its v2 calls is the next
group (DeepSeek-V3.2's DSA indexer or MiniMax-M3's index keys, ``indexer``; a hybrid
model's sliding-window K/V, ``swa``).
SGLang transfers each pool by its own call and reports each pool's pages separately, so
each call moves exactly one group; the hit is still one lookup over every group. The
indexer moves with the KV pool's host indices; the SWA pool has host slots of its own
(``own_slots``), since SGLang keeps only the pages at the end of a window there, and so
does the Mamba pool of a hybrid linear-attention model (``mamba``: one recurrent state
per checkpoint page, a slot each, over several buffers: each buffer is a pool tensor).

The host layout is part of each role's dtype, hence of every key: ``page_first`` and
``page_first_direct`` pages have the same size but another byte order, and a reader in
one layout must miss pages written in the other, never reinterpret them.

An MHA pool's K and V regions carry their unit layout (which bytes of a page hold which
KV head, :class:`kvconn.layout.UnitLayout`), so kvconn can cut them at a head
granularity finer than the rank's own (``shard_heads``; SGLang's ``tp_lcm_size``).
SGLang 0.5.23's MHA host buffers (``MHATokenToKVPoolHost.init_kv_buffer``) are, per
component (K, V) and page::

    layer_first        [layers][page_size][heads][head_dim]   one region per layer: outer page_size
    page_first         [page_size][layers][heads][head_dim]   outer page_size * layers
    page_first_direct  [layers][page_size][heads][head_dim]   outer layers * page_size
    page_head          [heads][page_size][layers][head_dim]   outer 1: a head's bytes are contiguous
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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

    ``kind`` is ``"mha"`` (``kv_buffer`` holds K and V on dim 0), ``"mla"`` (one latent
    per token, identical on every rank) or ``"indexer"`` (DeepSeek-V3.2's DSA index keys
    with their scales, one packed row per page and layer, identical on every rank:
    ``[layers, pages, bytes]`` in ``layer_first``, ``[pages, layers, 1, bytes]`` in the
    page-major layouts; SGLang allocates a page or two more than the KV pool, which no
    transfer addresses). ``name`` is SGLang's name of the pool (``kv``, ``indexer``,
    ``swa``); a side pool's K/V roles are named after it (``swa_k``, ``swa_v``).
    ``own_slots``: SGLang allocates the pool's host slots itself (SWA, Mamba) instead of
    moving it with the KV pool's host indices, so it may hold another number of pages.

    ``"index_k"`` is MiniMax-M3's sparse index keys (``MHATokenToKOnlyPoolHost``): one
    key vector per token and layer of the sparse layers, a single head SGLang's index
    projection computes whole on every rank, so identical on every rank; its buffer is
    shaped like an MLA latent's (``[layers, tokens, 1, dim]`` in ``layer_first``,
    ``[tokens, layers, 1, dim]`` in ``page_first``, ``[pages, layers, page_size, 1, dim]``
    in ``page_first_direct``) and moves with the KV pool's host indices.

    ``"kv_rows"`` is a K/V pool packed as one row per page and layer (MiniMax-M3.1's
    NVFP4 main cache, ``MiniMaxM3Nvfp4MainKVPoolHost``: the rank's K payload, K scales, V
    payload and V scales of the page's tokens), shaped like the DSA indexer's rows; it is
    split by heads over the ranks, but no head's bytes are one range, so its pages are
    never cut finer than a rank's. ``encoding`` names what such rows are (their buffer
    is bytes): it replaces the buffer's dtype in the roles' dtypes, hence in the keys.

    ``"mamba"`` is a hybrid linear-attention model's recurrent state: one slot per
    checkpoint (``page_size`` 1: the state at the end of a KV page), held in several
    buffers, ``components`` (name, tensor) in the order of SGLang's flat page, each
    ``[slots, layers, 1, …]`` (``page_first``) or ``[slots, …]`` (side states);
    ``kv_buffer`` is the first of them.
    """

    kind: str
    layout: str
    page_size: int
    layer_num: int
    size: int  # tokens, a multiple of page_size
    kv_buffer: torch.Tensor
    head_num: int = 1  # KV heads on this rank (MHA)
    name: str = "kv"
    #: The model's index of the pool's first layer: a pipeline stage's pool holds layers
    #: ``start_layer`` to ``start_layer + layer_num - 1``, and its pages are keyed by
    #: those numbers, so two stages' pages of one block never share a key.
    start_layer: int = 0
    own_slots: bool = False
    components: tuple[tuple[str, torch.Tensor], ...] = ()
    #: Whether the pool's layers are numbered as the model's (``start_layer`` onwards), so
    #: that a pipeline stage's pages are keyed apart from another's. SGLang numbers the
    #: layers of an SWA, Mamba or MiniMax index-key pool from 0 on every stage.
    model_layers: bool = True
    encoding: str | None = None
    #: A speculative draft model's weights (``EngineModel.tag``), named in the pool's
    #: roles' dtypes: drafts of one shape and other weights compute other bytes.
    weights: str | None = None

    @property
    def stored_components(self) -> tuple[tuple[str, torch.Tensor], ...]:
        """``components`` but those of no bytes (a conv-only model's temporal state),
        which add nothing to SGLang's flat page."""
        return tuple((name, tensor) for name, tensor in self.components if tensor.numel())

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The pool's tensors, each a kvconn pool of its own, in the layout's order."""
        if self.components:
            return tuple(tensor for _, tensor in self.stored_components)
        return (self.kv_buffer,)

    def __post_init__(self) -> None:
        first = self.start_layer
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise LayoutError(
                f"host pool {self.name!r}: start_layer must be a layer index (an int >= 0), "
                f"got {first!r}"
            )


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


def describe_host_pool(
    shape: HostPoolShape,
    tp_size: int,
    units: int,
    side_pools: Sequence[HostPoolShape] = (),
    side_units: Mapping[str, int] | None = None,
) -> KvLayout:
    """The kvconn layout of one rank's host pools; ``units`` is the K/V role's (MHA).

    ``shape`` is the KV pool (layer group 0, pool 0); each of ``side_pools`` is the next
    group over the next pool, with the KV pool's slot numbering (SGLang moves a side
    pool with the KV pool's host indices) or, with ``own_slots``, its own.
    ``side_units`` gives an MHA side pool's K/V units by pool name (global KV heads).
    """
    for pool in (shape, *side_pools):
        if pool.layout not in SUPPORTED_LAYOUTS:
            raise LayoutError(
                f"HiCache host layout {pool.layout!r} is not supported by kvconn; use one of "
                f"{', '.join(SUPPORTED_LAYOUTS)}"
            )
        if pool.size % pool.page_size != 0:
            raise LayoutError(
                f"host pool {pool.name!r} of {pool.size} tokens is not a whole number of "
                f"{pool.page_size}-token pages"
            )
        if pool.own_slots and pool.kind != "mamba" and pool.page_size != shape.page_size:
            raise LayoutError(
                f"host pool {pool.name!r} has {pool.page_size}-token pages, the KV pool "
                f"{shape.page_size}-token pages: a block is one page of every pool"
            )
        if not pool.own_slots and (pool.size, pool.page_size) != (shape.size, shape.page_size):
            raise LayoutError(
                f"host pool {pool.name!r} holds {pool.size} tokens in {pool.page_size}-token "
                f"pages, the KV pool {shape.size} in {shape.page_size}-token pages: a side "
                "pool must follow the KV pool's slots"
            )
    kv_pages = shape.size // shape.page_size
    roles: dict[str, Role] = {}
    groups: list[LayerGroup] = []
    first_pool = 0  # the kvconn pool index of the group's first tensor
    for index, pool in enumerate((shape, *side_pools)):
        element = pool.encoding or str(pool.kv_buffer.dtype).removeprefix("torch.")
        dtype = f"{element}:{pool.layout}"
        if pool.weights:
            dtype = f"{dtype}+draft={pool.weights}"
        pages = pool.size // pool.page_size if pool.own_slots else kv_pages
        pool_units = units if index == 0 else _side_units(pool, side_units)
        if pool.kind == "mamba":
            regions = _mamba_regions(pool, pool_units, first_pool, roles)
        else:
            regions = [
                Region.from_tensor(role, layer, view, pool.kv_buffer, first_pool, unit_dim)
                for role, views in _components(pool, pages, pool_units, dtype, roles)
                for layer, view, unit_dim in views
            ]
        label = f"hicache {pool.layout}" if index == 0 else f"hicache {pool.name} {pool.layout}"
        groups.append(LayerGroup(index, pages, tuple(regions), name=label))
        first_pool += len(pool.buffers)
    return KvLayout(
        tp_size=tp_size,
        tokens_per_block=shape.page_size,
        roles=tuple(roles.values()),
        groups=tuple(groups),
        pool_sizes=tuple(
            b.numel() * b.element_size() for p in (shape, *side_pools) for b in p.buffers
        ),
    )


def _mamba_regions(
    pool: HostPoolShape, units: int, first_pool: int, roles: dict[str, Role]
) -> list[Region]:
    """A Mamba pool's regions: per component, its slot's bytes (every layer of it), over
    the component's own tensor, in the order of SGLang's flat page (``get_data_page``).
    A component of no bytes (a conv-only model's temporal state) adds nothing to the
    flat page, and no region."""
    if pool.layout not in PAGE_MAJOR[:2]:
        raise LayoutError(
            f"host pool {pool.name!r}: SGLang's Mamba host pool is page_first or "
            f"page_first_direct, not {pool.layout}"
        )
    regions = []
    for offset, (name, tensor) in enumerate(pool.stored_components):
        if tensor.shape[0] != pool.size:
            raise LayoutError(
                f"host pool {pool.name!r}: its {name} buffer of shape {tuple(tensor.shape)} "
                f"does not hold {pool.size} slots on dimension 0"
            )
        dtype = str(tensor.dtype).removeprefix("torch.")
        role = _declare(pool, roles, Role(f"{pool.name}_{name}", units, dtype))
        view = tensor.reshape(pool.size, -1)
        regions.append(
            Region.from_tensor(role, pool.start_layer, view, tensor, first_pool + offset)
        )
    return regions


def _declare(pool: HostPoolShape, roles: dict[str, Role], role: Role) -> str:
    """Add ``role`` to the layout's roles (refused if a pool declared it already)."""
    if role.name in roles:
        raise LayoutError(f"host pool {pool.name!r}: role {role.name!r} is declared twice")
    roles[role.name] = role
    return role.name


def _side_units(pool: HostPoolShape, side_units: Mapping[str, int] | None) -> int:
    """A side pool's units by heads (K/V of an MHA pool, a Mamba state's), which the
    caller must give (1 for a pool identical on every rank)."""
    if pool.kind not in ("mha", "mamba"):
        return 1
    if side_units is None or pool.name not in side_units:
        raise LayoutError(f"host pool {pool.name!r} is split by heads, and no units were given")
    return side_units[pool.name]


#: A region of one role: its layer, its view (pages along dim 0, in the order of SGLang's
#: flat page) and the view's dimension of KV heads (``None``: no unit layout).
_Views = list[tuple[int, torch.Tensor, int | None]]


def _components(
    pool: HostPoolShape, pages: int, units: int, dtype: str, roles: dict[str, Role]
) -> list[tuple[str, _Views]]:
    """Per role of ``pool`` (declared into ``roles``), its ``(layer, view, unit_dim)``
    regions, each view a page per row in the order of SGLang's flat page."""

    def declare(role: Role) -> str:
        return _declare(pool, roles, role)

    buffer = pool.kv_buffer
    first = pool.start_layer  # a region's layer is the model's: a PP stage's own numbers
    named = "" if pool.name == "kv" else f"{pool.name}_"  # a side pool's roles: its own
    if pool.kind in ("indexer", "kv_rows"):
        # one packed row per page (and layer): the rows past the KV pool's pages are
        # never addressed by a transfer, so the slots are the KV pool's
        # DeepSeek-V3.2's own ``index_k``; a draft model's ``draft_index_k``
        if pool.kind == "indexer":
            role = declare(Role(pool.name.replace("indexer", "index_k"), 1, dtype))
        else:
            role = declare(Role(f"{named}kv", units, dtype))
        if pool.layout not in (LAYER_FIRST, "page_first", "page_first_direct"):
            raise LayoutError(f"SGLang has no {pool.layout} layout for the {pool.name} pool")
        if pool.layout == LAYER_FIRST:  # [layers, pages, bytes]
            _check_rows(pool, buffer, pages, layer_dim=0, page_dim=1, dims=3)
            return [
                (
                    role,
                    [
                        (first + layer, buffer[layer, :pages], None)
                        for layer in range(pool.layer_num)
                    ],
                )
            ]
        # [pages, layers, 1, bytes]: a whole page of every layer is one contiguous range
        _check_rows(pool, buffer, pages, layer_dim=1, page_dim=0, dims=4)
        return [(role, [(first, buffer[:pages].reshape(pages, -1), None)])]
    if pool.kind == "mha":
        components = [
            (declare(Role(f"{named}k", units, dtype)), buffer[0]),
            (declare(Role(f"{named}v", units, dtype)), buffer[1]),
        ]
    elif pool.kind == "mla":
        components = [(declare(Role(f"{named}latent", 1, dtype)), buffer)]
    elif pool.kind == "index_k":  # MiniMax-M3's index keys: one head, whole on every rank
        if pool.head_num != 1:
            raise LayoutError(
                f"host pool {pool.name!r}: an index-key pool holds one head, this one "
                f"{pool.head_num}"
            )
        components = [(declare(Role(pool.name.replace("indexer", "index_k"), 1, dtype)), buffer)]
    else:
        raise LayoutError(f"unknown host pool kind {pool.kind!r}")
    out: list[tuple[str, _Views]] = []
    for role, tensor in components:
        if pool.layout == LAYER_FIRST:
            # [layer, token, …]: one region per layer, a page is page_size token rows
            if tensor.shape[0] != pool.layer_num:
                raise LayoutError(
                    f"{role}: layer_first buffer has {tensor.shape[0]} layers, "
                    f"the host pool says {pool.layer_num}"
                )
            layers = range(pool.layer_num)
            out.append(
                (
                    role,
                    [(first + layer, *_by_heads(pool, tensor[layer], pages)) for layer in layers],
                )
            )
        else:
            # [page or token, …]: a whole page of every layer is one contiguous range,
            # declared as a region of the first (its size says how many layers follow)
            out.append((role, [(first, *_by_heads(pool, tensor, pages))]))
    return out


#: Per host layout, an MHA component's (K's or V's) dimensions but the last (head_dim),
#: by name (``tokens`` = pages * page_size); ``layer_first`` is one layer's.
_MHA_DIMS = {
    LAYER_FIRST: ("tokens", "heads"),
    "page_first": ("tokens", "layers", "heads"),
    "page_first_direct": ("pages", "layers", "page_size", "heads"),
    "page_head": ("pages", "heads", "page_size", "layers"),
}


def _by_heads(
    pool: HostPoolShape, tensor: torch.Tensor, pages: int
) -> tuple[torch.Tensor, int | None]:
    """A component's view, a page per row, and the view's dimension of KV heads.

    For MHA the view is ``[pages, outer, heads, inner]``: the same bytes as ``[pages,
    bytes of one page]``, with ``outer`` the page's dimensions before the heads (1 in
    ``page_head``). Any other pool, or an MHA buffer whose shape is not SGLang's for its
    layout, gets no unit layout: its pages are still stored, and kvconn refuses to cut
    them finer than the rank's heads.
    """
    flat = tensor.reshape(pages, -1)
    names = _MHA_DIMS.get(pool.layout)
    if pool.kind != "mha" or names is None:
        return flat, None
    sizes = {
        "tokens": pages * pool.page_size,
        "pages": pages,
        "heads": pool.head_num,
        "layers": pool.layer_num,
        "page_size": pool.page_size,
    }
    if tuple(tensor.shape[:-1]) != tuple(sizes[name] for name in names):
        return flat, None
    inner = math.prod(tensor.shape[names.index("heads") + 1 :])
    return tensor.reshape(pages, -1, pool.head_num, inner), 2


def _check_rows(
    pool: HostPoolShape,
    buffer: torch.Tensor,
    pages: int,
    *,
    layer_dim: int,
    page_dim: int,
    dims: int,
) -> None:
    """A side pool's buffer holds its layers and at least the KV pool's pages."""
    shape = tuple(buffer.shape)
    if len(shape) != dims or shape[layer_dim] != pool.layer_num or shape[page_dim] < pages:
        raise LayoutError(
            f"host pool {pool.name!r}: a {pool.layout} buffer of shape {shape} does not hold "
            f"{pool.layer_num} layers on dimension {layer_dim} and {pages} pages on "
            f"dimension {page_dim}"
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
