"""``ScheduledRequests``: one step's batch, as the connector manager reads it (stand-in)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ScheduledRequests:
    context_requests: list[Any] = field(default_factory=list)
    generation_requests: list[Any] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)
