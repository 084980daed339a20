"""KV block-cache policy specs as the CLI reads them: `kv-NAME` or `kv-NAME:key=value,...`."""

from __future__ import annotations

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.sim.kv_blocks.base import BlockCache
from sglang_marconi.sim.kv_blocks.fifo import FIFOBlockCache
from sglang_marconi.sim.kv_blocks.lfu import LFUBlockCache
from sglang_marconi.sim.kv_blocks.lru import LRUBlockCache
from sglang_marconi.sim.kv_blocks.s3fifo import S3FIFOBlockCache
from sglang_marconi.sim.units import parse_params

PREFIX = "kv-"
# name -> (class, parameter schema)
KV_POLICIES: dict[str, tuple[type[BlockCache], dict[str, type]]] = {
    "kv-lru": (LRUBlockCache, {}),
    "kv-lfu": (LFUBlockCache, {}),
    "kv-fifo": (FIFOBlockCache, {}),
    "kv-s3fifo": (S3FIFOBlockCache, {"small_ratio": float, "max_freq": int}),
}


def is_kv_policy(spec: str) -> bool:
    return spec.startswith(PREFIX)


def parse_kv_spec(spec: str) -> tuple[type[BlockCache], dict]:
    """The class and keyword parameters of `spec`; MarconiError names a bad name or value."""
    base, sep, params = spec.partition(":")
    if base not in KV_POLICIES:
        raise MarconiError(f"unknown KV policy {spec!r}; choose from {', '.join(KV_POLICIES)}")
    cls, schema = KV_POLICIES[base]
    if sep and not schema:
        raise MarconiError(f"policy {spec!r}: {base} takes no parameters")
    kwargs = parse_params(f"policy {spec!r}", params, schema)
    cls.check_params(**kwargs)
    return cls, kwargs


def build_block_cache(spec: str, capacity_blocks: int) -> BlockCache:
    cls, kwargs = parse_kv_spec(spec)
    return cls(capacity_blocks, **kwargs)
