"""kvconn's block hashes of a TensorRT-LLM request: what must match for two requests to
share a block, read off the request as the engine's own block keys read it.

TensorRT-LLM 1.2 keys a reusable block (``BlockKey`` in ``kvCacheManager.cpp``) by its
tokens, the request's LoRA task, its cache salt (``cache_salt_id``, mixed into the first
block, hence into every block after it) and, for each multimodal item whose placeholder
tokens overlap the block, the item's content hash and where in the item the block
starts. kvconn's chain takes the same inputs: the salt and the LoRA task seed the chain
(:class:`kvconn.ReuseScope`), and a block's multimodal items are its ``extras``. So the
text before the first image is shared between requests with different images, and a
block holding part of an image is shared only with requests holding the same image at
the same place.

A request kvconn cannot key safely is neither looked up nor saved (``None``):
multimodal inputs without usable hashes (placeholder tokens look alike across images),
and prompt tuning (``prompt_embedding_table``: virtual tokens whose KV depends on a
table the token ids do not name).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvconn.hashing import ReuseScope, block_hashes

log = logging.getLogger("kvconn.trtllm")

__all__ = ["mm_extras", "request_hashes", "request_scope"]

#: An item's content hash: 8 int32 words (TensorRT-LLM's blake3 digest, in 32-bit parts).
HASH_WORDS = 8
#: whether a request with unusable multimodal inputs was logged (once, then debug)
_warned = False


def request_scope(request: Any) -> ReuseScope:
    """The cache salt and LoRA task of a request, as kvconn's chain seed."""
    salt = getattr(request, "cache_salt_id", None)
    lora = getattr(request, "lora_task_id", None)
    return ReuseScope(
        cache_salt="" if salt is None else f"trtllm-salt:{int(salt)}",
        lora_id=None if lora is None else str(lora),
    )


def mm_extras(request: Any, tokens_per_block: int, blocks: int) -> list[bytes] | None:
    """Per block, the multimodal items it overlaps: each item's 32-byte content hash and
    the offset into the item at which the block starts (0 when the item starts inside
    the block), in item order; ``b""`` for a block of text only. ``[]`` for a request
    without multimodal inputs; ``None`` when it has some but they cannot be keyed
    (missing or inconsistent hashes, positions or lengths).
    """
    hashes = getattr(request, "multimodal_hashes", None)
    if not hashes:
        if getattr(request, "multimodal_embedding", None) is not None:
            return None  # an image with no hash to tell it from another
        return []
    positions = getattr(request, "multimodal_positions", None)
    lengths = getattr(request, "multimodal_lengths", None)
    if (
        positions is None
        or lengths is None
        or not (len(hashes) == len(positions) == len(lengths))
        or any(len(h) != HASH_WORDS for h in hashes)
        or any(p < 0 or n < 1 for p, n in zip(positions, lengths))
    ):
        return None
    items = [
        (b"".join((int(w) & 0xFFFFFFFF).to_bytes(4, "big") for w in h), int(p), int(n))
        for h, p, n in zip(hashes, positions, lengths)
    ]
    extras = []
    for b in range(blocks):
        start, end = b * tokens_per_block, (b + 1) * tokens_per_block
        extras.append(
            b"".join(
                digest + max(0, start - pos).to_bytes(8, "little")
                for digest, pos, length in items
                if end > pos and start < pos + length
            )
        )
    return extras


def request_hashes(
    request: Any, tokens: Sequence[int], tokens_per_block: int
) -> list[bytes] | None:
    """kvconn's hashes of the full blocks of ``tokens`` (the request's prompt), or
    ``None`` when the request's blocks must not be shared through the store."""
    if getattr(request, "prompt_embedding_table", None) is not None:
        return None
    extras = mm_extras(request, tokens_per_block, len(tokens) // tokens_per_block)
    if extras is None:
        global _warned
        (log.debug if _warned else log.warning)(
            "kvconn: request %s has multimodal inputs without usable hashes, positions "
            "and lengths; it is neither looked up nor saved",
            getattr(request, "request_id", "?"),
        )
        _warned = True
        return None
    return block_hashes(tokens, tokens_per_block, request_scope(request), extras or None)
