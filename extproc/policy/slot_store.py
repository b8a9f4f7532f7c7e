"""Where class slots are counted: the SlotStore interface, the in-process default, and per-replica shares."""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

from .schema import Policy

# Fail-closed refusal while the shared store is unreachable (a reason like admission's R_* constants).


class StoreUnavailable(Exception):
    """The store did not answer in time or at all; the caller switches to the policy's `on_failure`."""


@dataclasses.dataclass(frozen=True, slots=True)
class SlotClaim:
    """One request's hold on a class slot as the store knows it (ids are unique across replicas)."""

    cls: str
    holder: str           # "<replica id>:<ticket id>"
    cost: float           # estimated GPU-seconds counted against the class budget
    cap: int              # the class's max_concurrency
    budget: float | None  # the class's max_inflight_gpu_seconds


class SlotStore(Protocol):
    """Slots and GPU-second budgets of each class, shared by every replica that uses the same store.

    Every slot is a lease: taken by acquire(), kept alive by renew(), given back by release() or by expiring.
    Calls raise StoreUnavailable when the store is unreachable or slower than its timeout.
    """

    shared: bool  # False: the local ClassLimiter is the whole truth and the adapter skips the store

    async def acquire(self, claim: SlotClaim) -> bool:
        """Take a slot if the class has one free (count and budget) across all holders; atomic, idempotent."""
        ...

    async def release(self, slots: list[tuple[str, str]]) -> None:
        """Give (class, holder) slots back and tell the other replicas, in one round trip. Idempotent:
        releasing twice or unknown holders is a no-op."""
        ...

    async def renew(self, held: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Extend the leases of these (class, holder) slots; returns those that were no longer held."""
        ...

    async def adopt(self, claims: list[SlotClaim]) -> None:
        """Record slots of requests that are already running, past the cap if need be (admitted while the
        store was unreachable): the shared count must show what really runs."""
        ...

    async def ping(self) -> None:
        """Raise StoreUnavailable unless the store answers."""
        ...

    def on_release(self, callback: Callable[[str], None]) -> None:
        """Call `callback(class)` whenever any replica releases a slot of that class."""
        ...

    def forget(self, cls: str) -> None:
        """A reload removed the class: drop what this process keeps of it (its slots still held are released as
        ever, by (class, holder))."""
        ...

    async def start(self) -> None: ...
    async def close(self) -> None: ...


class LocalStore:
    """The default: nothing is shared, each replica's own limiters count its slots (kind: memory)."""

    shared = False

    async def acquire(self, claim: SlotClaim) -> bool:
        return True

    async def release(self, slots: list[tuple[str, str]]) -> None:
        pass

    async def renew(self, held: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return []

    async def adopt(self, claims: list[SlotClaim]) -> None:
        pass

    async def ping(self) -> None:
        pass

    def on_release(self, callback: Callable[[str], None]) -> None:
        pass

    def forget(self, cls: str) -> None:
        pass

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


def local_share(policy: Policy, instances: int) -> Policy:
    """The policy one of `instances` replicas enforces on its own while the shared store is unreachable:
    each class's cap and GPU-second budget divided evenly (at least one slot), so the replicas together stay
    within the shared caps."""
    if instances <= 1:
        return policy
    classes = {}
    for name, spec in policy.classes.items():
        budget = spec.max_inflight_gpu_seconds
        adaptive = spec.adaptive
        if adaptive.enabled:  # an adaptive cap moves within its share too
            adaptive = dataclasses.replace(adaptive, min_limit=max(1, adaptive.min_limit // instances),
                                           max_limit=max(1, adaptive.max_limit // instances))
        classes[name] = dataclasses.replace(
            spec, max_concurrency=max(1, spec.max_concurrency // instances), adaptive=adaptive,
            max_inflight_gpu_seconds=budget / instances if budget is not None else None)
    return dataclasses.replace(policy, classes=classes)


def share_has_room(running: list[SlotClaim], claim: SlotClaim, limit: int, budget: float | None) -> bool:
    """Whether a replica failing open may start `claim` within its share of a class: fewer than `limit` running
    and the GPU-second `budget` (if any) not exceeded. `running` is every request of the class running on this
    replica, those admitted with a global slot before the store went away included."""
    if len(running) >= limit:
        return False
    return budget is None or sum(c.cost for c in running) + claim.cost <= budget * (1 + 1e-9)
