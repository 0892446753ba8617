"""The connector interface, as documented for TensorRT-LLM 1.2 (stand-in, see package).

The scheduler half runs on rank 0 only; what ``build_connector_meta`` returns is
broadcast to every rank and bound to that rank's worker before the forward pass. The
worker gets the rank's primary KV pool once, shaped
``[num_blocks, num_layers, kv_factor, tokens_per_block * num_kv_heads * head_dim]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestData:
    request_id: int
    new_tokens: list[int]
    new_block_ids: list[int]
    computed_position: int
    num_scheduled_tokens: int


@dataclass
class SchedulerOutput:
    new_requests: list[RequestData] = field(default_factory=list)
    cached_requests: list[RequestData] = field(default_factory=list)


class KvCacheConnectorWorker(ABC):
    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args
        self._metadata: Any = None

    def bind_connector_meta(self, metadata: Any) -> None:
        self._metadata = metadata

    def get_connector_meta(self) -> Any:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor: Any) -> None: ...

    @abstractmethod
    def start_load_kv(self, stream: Any) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, stream: Any) -> None: ...

    @abstractmethod
    def wait_for_save(self, stream: Any) -> None: ...

    @abstractmethod
    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]: ...


class KvCacheConnectorScheduler(ABC):
    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any: ...

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]: ...

    @abstractmethod
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool: ...

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        pass
