"""``LlmRequestState``: the request states the connector manager reads and sets (stand-in).

TensorRT-LLM binds this enum from C++; only the members the KV-cache connector path
touches are here, with the meanings the 1.2 executor gives them.
"""

from __future__ import annotations

import enum


class LlmRequestState(enum.Enum):
    #: scheduled for (the next chunk of) its prompt
    CONTEXT_INIT = enum.auto()
    GENERATION_IN_PROGRESS = enum.auto()
    GENERATION_COMPLETE = enum.auto()
    #: waiting for an asynchronous connector load: not schedulable
    DISAGG_GENERATION_TRANS_IN_PROGRESS = enum.auto()
    #: finished, its blocks held for an asynchronous connector save
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = enum.auto()
