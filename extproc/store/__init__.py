"""Shared slot stores (Redis) and the adapter logic that confirms admissions with them."""

from __future__ import annotations

from ..policy.schema import StoreSpec
from ..policy.slot_store import LocalStore, SlotStore


def open_store(spec: StoreSpec) -> SlotStore:
    """The store a policy's `store` section selects (Redis is imported only when used)."""
    if spec.kind == "redis":
        from .redis_store import RedisStore
        return RedisStore(spec)
    return LocalStore()
