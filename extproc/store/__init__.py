"""Shared slot stores (Redis, the workers' host memory) and the adapter logic that confirms admissions with them."""

from __future__ import annotations

from ..policy.schema import StoreSpec
from ..policy.slot_store import LocalStore, SlotStore


def open_store(spec: StoreSpec, host: SlotStore | None = None) -> SlotStore:
    """The store a policy's `store` section selects (Redis is imported only when used). `host`: the table the
    workers of one `extproc serve --workers N` share, which `memory` means for them."""
    if spec.kind == "memory" and host is not None:
        return host
    if spec.kind == "redis":
        from .redis_store import RedisStore
        return RedisStore(spec)
    return LocalStore()
