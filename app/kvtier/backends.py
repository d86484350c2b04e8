"""TierConfig -> a backend. Backends are imported only when chosen: a server without a
Redis tier never loads redis-py (a dependency of Parley's, also used by the journal)."""

from __future__ import annotations

from app.config import TierConfig
from app.kvtier.tier import Tier


def open_tier(config: TierConfig, namespace: str) -> Tier:
    """The backend `config` names, its entries under `namespace` (a fingerprint's hex).
    A Redis that cannot be reached yet still gives a tier: it reconnects by itself."""
    if config.kind == "memory":
        from app.kvtier.memory import MemoryTier

        return MemoryTier(config.size_bytes, config.describe())
    if config.kind == "disk":
        from app.kvtier.disk import DiskTier

        return DiskTier(config.location, namespace, config.size_bytes)
    if config.kind == "redis":
        try:
            from app.kvtier.redis import RedisTier
        except ImportError as exc:
            raise RuntimeError(
                "--kv-tier redis://... needs the redis client, a dependency of Parley's: "
                "pip install 'redis>=5'"
            ) from exc
        return RedisTier(config.location, namespace, config.ttl_s, config.timeout_s)
    raise ValueError(f"no tier for kind {config.kind!r}")
