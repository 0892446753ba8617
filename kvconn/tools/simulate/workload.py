"""A seeded chat workload whose prefixes repeat the way real serving traffic does.

Two sources of reuse, both present in production traffic:

* **shared system prompts** -- many conversations start with one of a few long system
  prompts, so their first blocks are the same across conversations;
* **multi-turn conversations** -- turn ``t`` resends the whole history (system prompt,
  earlier user messages and the model's replies) plus a new user message, so it hits
  every full block of turn ``t - 1``'s prompt.

Conversations are interleaved (a few are "open" at once, as concurrent users are), and
everything derives from one seed through :class:`random.Random`, whose sequence is
stable across runs and machines: running twice replays exactly the same token streams,
so a second run hits what the first one stored.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvconn.errors import ConfigError


@dataclass(frozen=True)
class WorkloadSpec:
    seed: int = 0
    conversations: int = 12
    turns: int = 4  # each conversation draws its turn count from 1..turns
    system_prompts: int = 3
    system_tokens: tuple[int, int] = (256, 1024)
    user_tokens: tuple[int, int] = (32, 256)
    reply_tokens: tuple[int, int] = (64, 320)
    concurrency: int = 4  # conversations open at once
    vocab: int = 151_936  # Qwen-sized vocabulary; only the distribution of ids matters

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"workload: seed must be an int, got {self.seed!r}")
        for name, high in _COUNT_BOUNDS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise ConfigError(
                    f"workload: {name} must be an int between 1 and {high:,}, got {value!r}"
                )
        for name in ("system_tokens", "user_tokens", "reply_tokens"):
            bounds = getattr(self, name)
            if (
                not isinstance(bounds, tuple)
                or len(bounds) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)
                or not 0 <= bounds[0] <= bounds[1] <= MAX_MESSAGE_TOKENS
            ):
                raise ConfigError(
                    f"workload: {name} must be MIN:MAX with 0 <= MIN <= MAX <= "
                    f"{MAX_MESSAGE_TOKENS:,}, got {bounds!r}"
                )
        if self.user_tokens[0] < 1:
            raise ConfigError("workload: user messages need at least 1 token")

    def max_prompt_tokens(self) -> int:
        """An upper bound of all prompts' tokens together: every conversation takes every
        turn with the longest messages. Known before generating anything."""
        turns = self.turns
        per_conversation = (
            turns * self.system_tokens[1]
            + self.user_tokens[1] * turns * (turns + 1) // 2
            + self.reply_tokens[1] * turns * (turns - 1) // 2
        )
        return self.conversations * per_conversation


#: Bounds only a typo reaches; the memory check (budget.py) catches the combinations.
_COUNT_BOUNDS = {
    "conversations": 1_000_000,
    "turns": 10_000,
    "system_prompts": 100_000,
    "concurrency": 1_000_000,
    "vocab": 1 << 40,
}
MAX_MESSAGE_TOKENS = 10_000_000


@dataclass(frozen=True)
class Request:
    index: int
    conversation: int
    turn: int
    system_prompt: int
    tokens: tuple[int, ...]


def parse_range(text: str) -> tuple[int, int]:
    """``"32:256"`` -> ``(32, 256)``; ``"64"`` -> ``(64, 64)``."""
    lo, sep, hi = text.partition(":")
    try:
        low = int(lo)
        high = int(hi) if sep else low
    except ValueError:
        raise ConfigError(f"expected MIN:MAX token counts, got {text!r}") from None
    if not 0 <= low <= high:
        raise ConfigError(f"expected 0 <= MIN <= MAX, got {text!r}")
    return low, high


def generate(spec: WorkloadSpec) -> list[Request]:
    """The requests in arrival order."""
    rng = random.Random(spec.seed)

    def tokens(bounds: tuple[int, int]) -> list[int]:
        return [rng.randrange(spec.vocab) for _ in range(rng.randint(*bounds))]

    systems = [tokens(spec.system_tokens) for _ in range(spec.system_prompts)]
    plans = [
        (rng.randrange(spec.system_prompts), rng.randint(1, spec.turns))
        for _ in range(spec.conversations)
    ]
    history: dict[int, list[int]] = {}
    turn_of: dict[int, int] = {}
    waiting = list(range(spec.conversations))
    open_: list[int] = []
    out: list[Request] = []
    while waiting or open_:
        while waiting and len(open_) < spec.concurrency:
            c = waiting.pop(0)
            open_.append(c)
            history[c] = list(systems[plans[c][0]])
            turn_of[c] = 0
        c = rng.choice(open_)
        prompt = history[c] + tokens(spec.user_tokens)
        out.append(Request(len(out), c, turn_of[c], plans[c][0], tuple(prompt)))
        turn_of[c] += 1
        if turn_of[c] >= plans[c][1]:
            open_.remove(c)
            del history[c]
        else:
            history[c] = prompt + tokens(spec.reply_tokens)  # the model's answer
    return out
