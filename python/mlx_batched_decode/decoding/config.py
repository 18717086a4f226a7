"""The engine's configuration: checked dataclasses, each validated once when made.

``CacheConfig`` (where keys/values live), ``SchedulerConfig`` (what a step carries) and
``SpeculativeConfig`` (draft tokens per step) each check their own fields in ``__post_init__``;
``EngineConfig`` holds the three and refuses the combinations no layout serves, so a bad
setting is refused in one place with one message, whoever made it (``BatchedDecoder``'s
keywords or the server's flags). ``add_flags`` and ``from_flags`` generate a parser's flags
from the fields (names, types, choices and help texts) and read them back.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from ..caches.paged_kv_cache import DEFAULT_POOL_LAYOUT, POOL_LAYOUTS
from ..caches.quantized_kv_cache import check_quantization

PREFIX = "[BatchedDecoder]"
# "seed" is the pad-and-concatenate baseline: per-request caches, a mask, MLX's SDPA.
KV_LAYOUTS = ("slot", "paged", "seed")


def _flag(help: str, none: str = "none", **options: Any) -> dict:
    """A field's metadata: its flag's help text, what a default of ``None`` means (``none``)
    and argparse options (``choices``, ...)."""
    return {"help": help, "none": none, **options}


def _at_least(name: str, value: Optional[int], low: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if value is None or value < low:
        none = " or None" if optional else ""
        raise ValueError(f"{PREFIX} {name} must be >= {low}{none}, got {value}")


@dataclass(frozen=True)
class CacheConfig:
    """Where the keys and values of the requests live (the KV layout) and how they grow."""

    kv_layout: str = field(default="slot", metadata=_flag(
        "slot: a cache row per request, read in place; paged: block pools with prefix "
        "sharing; seed: per-request caches padded and concatenated (the baseline)",
        choices=KV_LAYOUTS))
    kv_step: int = field(default=256, metadata=_flag(
        "the slot and seed caches grow by this many positions"))
    block_size: int = field(default=16, metadata=_flag("positions per block (paged layout)"))
    pool_layout: str = field(default=DEFAULT_POOL_LAYOUT, metadata=_flag(
        "how the paged layout stores its pools", choices=POOL_LAYOUTS))
    prefix_sharing: bool = field(default=True, metadata=_flag(
        "share the cached blocks of equal prompt prefixes (paged layout)"))
    max_kv_blocks: Optional[int] = field(default=None, metadata=_flag(
        "the block budget (paged layout): a request waits until blocks for its whole length "
        "can be reserved, and one larger than the budget is refused", none="unbounded"))
    max_cached_blocks: int = field(default=256, metadata=_flag(
        "the most prompt blocks no request holds kept for later requests (paged layout)"))
    kv_bits: Optional[int] = field(default=None, metadata=_flag(
        "keep keys/values quantized to this many bits (slot layout)", none="unquantized",
        choices=(4, 8)))
    kv_group_size: int = field(default=64, metadata=_flag(
        "elements per quantization group with kv_bits", choices=(32, 64, 128)))

    def __post_init__(self) -> None:
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(
                f"{PREFIX} kv_layout must be 'slot' or 'paged' (or 'seed', the baseline), "
                f"got {self.kv_layout!r}"
            )
        _at_least("kv_step", self.kv_step, 1)
        _at_least("block_size", self.block_size, 1)
        if self.pool_layout not in POOL_LAYOUTS:
            raise ValueError(
                f"{PREFIX} pool_layout must be one of {POOL_LAYOUTS}, got {self.pool_layout!r}"
            )
        _at_least("max_kv_blocks", self.max_kv_blocks, 1, optional=True)
        _at_least("max_cached_blocks", self.max_cached_blocks, 0)
        if self.kv_bits is not None:
            check_quantization("BatchedDecoder", self.kv_bits, self.kv_group_size)
            if self.kv_layout == "paged":
                raise ValueError(
                    f"{PREFIX} kv_bits needs kv_layout='slot': paged pools are not quantized"
                )
            if self.kv_layout == "seed":
                raise ValueError(
                    f"{PREFIX} kv_bits needs attention='slot': the seed path keeps "
                    "unquantized per-request caches"
                )


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler puts in a step and how many requests it holds at once."""

    max_step_tokens: int = field(default=256, metadata=_flag(
        "tokens per step: every running request's decode tokens (always, past it too), then "
        "chunks of the prompts being fed, first come first served"))
    max_batch_size: Optional[int] = field(default=None, metadata=_flag(
        "the most requests prefilling or decoding at once; the others wait in arrival order",
        none="unbounded"))

    def __post_init__(self) -> None:
        _at_least("max_step_tokens", self.max_step_tokens, 1)
        _at_least("max_batch_size", self.max_batch_size, 1, optional=True)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: the draft model's tokens per request and step."""

    num_draft_tokens: int = field(default=2, metadata=_flag(
        "draft tokens per request and step with a draft model"))

    def __post_init__(self) -> None:
        _at_least("num_draft_tokens", self.num_draft_tokens, 1)


@dataclass(frozen=True)
class EngineConfig:
    """The three configs and whether a draft model decodes speculatively; refuses the
    combinations no layout serves."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    draft: bool = False

    def __post_init__(self) -> None:
        if self.cache.kv_layout == "paged" and self.draft:
            raise ValueError(
                f"{PREFIX} kv_layout='paged' does not decode speculatively: pass no draft_model"
            )



def add_flags(group: Any, config: Any) -> None:
    """Add a ``--name`` flag to ``group`` (an argparse parser or group) for every field of the
    config instance ``config``, its value the default, its metadata the help and choices."""
    hints = typing.get_type_hints(type(config))
    for item in dataclasses.fields(config):
        default = getattr(config, item.name)
        options = dict(item.metadata)
        none = options.pop("none")
        shown = none if default is None else default
        options["help"] = f"{options['help']} (default: {shown})"
        flag = "--" + item.name.replace("_", "-")
        if hints[item.name] is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                               **options)
            continue
        kind = typing.get_args(hints[item.name]) or (hints[item.name],)
        group.add_argument(flag, type=kind[0], default=default, **options)


def from_flags(kind: type, args: argparse.Namespace) -> Any:
    """The config of class ``kind`` from the parsed flags ``add_flags`` added; ``ValueError``
    as its checks say."""
    return kind(**{item.name: getattr(args, item.name) for item in dataclasses.fields(kind)})
