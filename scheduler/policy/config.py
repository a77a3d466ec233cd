"""Scheduler limits: the knobs of one SchedulerCore (one DP rank)."""

from __future__ import annotations

import attrs

POLICIES = ("fcfs", "priority")


class ConfigError(ValueError):
    """A configuration value out of range; the message names the field and what is allowed."""


def int_at_least(table: str, low: int):
    """An attrs validator: an integer >= ``low``, named ``table.field`` in the error."""
    def check(inst, attribute, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{table}.{attribute.name} must be an integer >= {low}, got {value!r}")
    return check


def int_between(table: str, low: int, high: int, why: str):
    """An attrs validator: an integer in [low, high], named ``table.field``; ``why`` says what
    the upper bound protects."""
    def check(inst, attribute, value):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(f"{table}.{attribute.name} must be an integer in [{low}, {high:,}] ({why}), "
                              f"got {value!r}")
    return check


_positive = int_at_least("scheduler", 1)
_non_negative = int_at_least("scheduler", 0)


@attrs.frozen
class SchedulerConfig:
    num_blocks: int = attrs.field(default=4096, validator=_positive)
    block_size: int = attrs.field(default=16, validator=int_between("scheduler", 2, 4096, "tokens a KV block holds"))
    # (a rank keeps per-slot arrays of this size: 65,536 is far past any GPU's batch)
    max_num_seqs: int = attrs.field(default=256, validator=int_between("scheduler", 1, 65536,
                                                                        "requests one rank runs at once"))
    max_num_batched_tokens: int = attrs.field(default=8192, validator=_positive)
    max_model_len: int = attrs.field(default=131072, validator=_positive)
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    # Admission caps: 0 means no cap. KV loads are requests whose KV arrives from elsewhere.
    max_new_prefills_per_step: int = attrs.field(default=0, validator=_non_negative)
    max_kv_loads_per_step: int = attrs.field(default=4, validator=_non_negative)
    num_spec_tokens: int = attrs.field(default=0, validator=_non_negative)
    host_cache_blocks: int = attrs.field(default=0, validator=_non_negative)  # host KV tier
    async_scheduling: bool = True
    watermark: float = 0.01  # share of blocks kept free when admitting new requests
    # Prompt tokens a step may score for prompt logprobs (requests with prompt_logprobs are
    # chunked to it): their rows travel in the step's result, which must fit the ring.
    max_scored_tokens_per_step: int = attrs.field(default=4096, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"scheduler.policy must be one of {POLICIES}, got {self.policy!r}")
        if self.block_size % 2:
            raise ConfigError(f"scheduler.block_size must be even, got {self.block_size}")
        if 0 < self.host_cache_blocks < 2 * self.num_blocks:
            # An admission's evictions into the host tier must not push out the blocks it
            # is about to load from there.
            raise ConfigError(
                f"scheduler.host_cache_blocks must be 0 (no host tier) or at least twice "
                f"num_blocks ({2 * self.num_blocks}), got {self.host_cache_blocks}"
            )
        if not 0 <= self.watermark < 1:
            raise ConfigError(f"scheduler.watermark must be in [0, 1), got {self.watermark!r}")

    @property
    def request_blocks(self) -> int:
        """The most KV blocks one request may hold: all but the watermark's share."""
        return self.num_blocks - int(self.watermark * self.num_blocks)

    @property
    def request_tokens(self) -> int:
        """The longest prompt + max_tokens this rank's KV cache can hold for one request."""
        return self.request_blocks * self.block_size
