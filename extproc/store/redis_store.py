"""Class slots shared through Redis: leases in a sorted set per class, taken and given back by Lua scripts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Callable

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from ..policy.schema import StoreSpec
from ..policy.slot_store import SlotClaim, StoreUnavailable

log = logging.getLogger("extproc.store")

# Keys per class: <prefix>slots:<class> is a sorted set of holders scored by lease deadline (Redis server time in
# ms, so replicas' clocks never matter); <prefix>cost:<class> maps holders to their GPU-second cost. An acquire
# first drops expired holders from both, inside the same atomic call: a crashed replica's slots free themselves.

# Every script but the release starts here: Redis's clock (never a replica's) and the lease from ARGV[1]. Their
# last two KEYS are <prefix>epoch and <prefix>settle, their last two ARGV what this replica knows (0: it never saw
# the epoch, 1: it did, 2: it did and is back from an outage longer than a lease) and the settling time in ms: see
# settling().
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local n = #KEYS - 2
-- A Redis that lost its data (restarted without persistence, rescheduled) has forgotten every running request: an
-- acquire on it was granted up to the whole cap again while the others' requests ran on, adopted past the cap at
-- their next renewal (a cap of 4 on two replicas ran 8 for as long as those requests lasted). The epoch key is
-- written once and has no lease; a replica that saw it and finds it gone (or one back from an outage longer than a
-- lease, whose holders expired meanwhile) starts the settling: no acquire is granted until every live replica's
-- housekeeping has renewed or adopted what it runs.
local function settling()
  local knows = ARGV[#ARGV - 1]
  local recover = knows == '2'
  if redis.call('EXISTS', KEYS[n + 1]) == 0 then
    redis.call('SET', KEYS[n + 1], '1')
    if knows ~= '0' then recover = true end
  end
  if recover then redis.call('SET', KEYS[n + 2], '1', 'PX', tonumber(ARGV[#ARGV])) end
  return redis.call('EXISTS', KEYS[n + 2]) == 1
end
"""

# KEYS: slots and cost of each claim's class. ARGV: lease_ms, then holder, cost, cap, budget (< 0: none) per
# claim. Returns 1 (held) or 0 (class full) per claim, deciding them in order: a batch of concurrent acquires
# from one replica costs one round trip.
ACQUIRE = _NOW + """
local purged = {}
local out = {}
if settling() then
  for i = 1, n, 2 do out[#out + 1] = 0 end
  return out
end
for i = 1, n, 2 do
  local slots, costs, a = KEYS[i], KEYS[i + 1], 2 * i
  local holder, cost, cap, budget = ARGV[a], tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  if not purged[slots] then
    purged[slots] = true
    local expired = redis.call('ZRANGEBYSCORE', slots, '-inf', now)
    if #expired > 0 then
      redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)
      for _, h in ipairs(expired) do redis.call('HDEL', costs, h) end
    end
  end
  local held = 0
  if redis.call('ZSCORE', slots, holder) then  -- a retried acquire that already went through
    held = 1
  elseif redis.call('ZCARD', slots) < cap then
    held = 1
    if budget >= 0 then
      local sum = 0
      for _, v in ipairs(redis.call('HVALS', costs)) do sum = sum + tonumber(v) end
      if sum + cost > budget * (1 + 1e-9) then held = 0 end
    end
  end
  if held == 1 then
    redis.call('ZADD', slots, now + lease, holder)
    redis.call('HSET', costs, holder, ARGV[a + 1])
    redis.call('PEXPIRE', slots, lease * 2)
    redis.call('PEXPIRE', costs, lease * 2)
  end
  out[#out + 1] = held
end
return out
"""

# KEYS: slots and cost of each released slot's class, then the channel. ARGV: holder and class per slot.
# Announces each class that got a slot back, once per call.
RELEASE = """
local channel = KEYS[#KEYS]
local freed = {}
for i = 1, #KEYS - 1, 2 do
  if redis.call('ZREM', KEYS[i], ARGV[i]) > 0 then freed[ARGV[i + 1]] = true end
  redis.call('HDEL', KEYS[i + 1], ARGV[i])
end
local n = 0
for cls in pairs(freed) do
  redis.call('PUBLISH', channel, cls)
  n = n + 1
end
return n
"""

# KEYS: slots and cost of each held slot's class, in order. ARGV: lease_ms, then one holder per slot. Extends
# only slots still held: a lease that already expired stays gone (its holder is told, and may adopt() it again).
# The costs' key is kept alive with the slots': else it expired two leases after the class's last acquire, and a
# class held at its GPU budget by long requests was counted as costing nothing.
RENEW = _NOW + """
settling()
local out = {}
for i = 1, n, 2 do
  local key, holder = KEYS[i], ARGV[(i + 1) / 2 + 1]
  local score = redis.call('ZSCORE', key, holder)
  if score and tonumber(score) > now then
    redis.call('ZADD', key, now + lease, holder)
    redis.call('PEXPIRE', key, lease * 2)
    redis.call('PEXPIRE', KEYS[i + 1], lease * 2)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
"""

# KEYS: slots, cost per class of each adopted slot. ARGV: lease_ms, then holder and cost per class. Records
# requests that are already running (admitted while Redis was away) whatever the cap: the count must show them.
ADOPT = _NOW + """
settling()
for i = 1, n, 2 do
  local j = i + 1
  redis.call('ZADD', KEYS[i], now + lease, ARGV[j])
  redis.call('HSET', KEYS[i + 1], ARGV[j], ARGV[j + 1])
  redis.call('PEXPIRE', KEYS[i], lease * 2)
  redis.call('PEXPIRE', KEYS[i + 1], lease * 2)
end
return n / 2
"""

# The probe (a write: see ping()). KEYS: the probe's key. ARGV: lease_ms.
PROBE = _NOW + """
redis.call('SET', KEYS[1], '1', 'PX', lease)
settling()
return 1
"""


# How long acquires wait after Redis lost its slots (see settling()): two housekeeping rounds (each second) and
# their round trips, so that every live replica has recorded the requests it runs again.
SETTLE_MS = 2500
MAX_CONNECTIONS = 64  # per replica; each call holds one for a round trip, so this bounds calls in flight


class RedisStore:
    """SlotStore on Redis (redis-py asyncio): one script call per batch of acquires (one call in flight per
    replica, so an admission waits for at most two round trips under load), one per release, one per renewal
    batch."""

    shared = True

    def __init__(self, spec: StoreSpec, client: aioredis.Redis | None = None):
        """`client`: one the caller made, and closes (close() leaves it open); else the store makes its own."""
        self.spec = spec
        self.prefix = spec.key_prefix
        self.lease_ms = spec.lease_ms
        self.timeout_s = spec.timeout_ms / 1000.0
        self.channel = f"{self.prefix}released"
        # No client-side retries: one call, bounded by timeout_ms, then the caller's on_failure takes over. A
        # bounded pool that makes callers wait for a free connection (within the same timeout) rather than fail.
        self._owns_client = client is None
        self.client = client or aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
            spec.url, max_connections=MAX_CONNECTIONS, timeout=self.timeout_s, socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s, retry=Retry(NoBackoff(), 0), health_check_interval=0))
        self._acquire = self.client.register_script(ACQUIRE)
        self._release = self.client.register_script(RELEASE)
        self._renew = self.client.register_script(RENEW)
        self._adopt = self.client.register_script(ADOPT)
        self._probe = self.client.register_script(PROBE)
        self._seen_epoch = False  # a script went through: the store's epoch exists, or this replica wrote it
        self._failing_since: float | None = None  # monotonic time of the first failed call since one went through
        self._recovering = False  # back after failing longer than a lease: the next script starts the settling
        self._listeners: list[Callable[[str], None]] = []
        self._to_acquire: list[tuple[SlotClaim, asyncio.Future]] = []
        self._acquirer: asyncio.Task | None = None
        self._busy = False  # an acquire call is on its way
        self._subscriber: asyncio.Task | None = None
        self._reports: tuple[str, Callable[[list[list]], None]] | None = None  # this instance's channel, handler
        self._relaying: set[asyncio.Task] = set()  # publishes in flight (held: the loop keeps only weak refs)
        self._dropping: asyncio.Task | None = None  # the pool's connections being dropped after a failed call

    def keys(self, cls: str) -> list[str]:
        return [f"{self.prefix}slots:{cls}", f"{self.prefix}cost:{cls}"]

    async def _script(self, script, keys: list[str], args: list):
        """A slot script, with the epoch's keys and arguments (settling() in the scripts)."""
        knows = 2 if self._recovering else int(self._seen_epoch)
        out = await self._call(script(keys=[*keys, f"{self.prefix}epoch", f"{self.prefix}settle"],
                                      args=[*args, knows, SETTLE_MS]))
        self._seen_epoch = True
        if knows == 2:
            self._recovering = False
        return out

    async def _call(self, coro):
        try:
            async with asyncio.timeout(self.timeout_s):
                out = await coro
        except (RedisError, OSError, TimeoutError) as e:
            if self._failing_since is None:
                self._failing_since = time.monotonic()
            self._drop_connections()
            raise StoreUnavailable(f"redis {type(e).__name__}: {e}") from None
        if self._failing_since is not None:
            # Leases are renewed every second: failing for a lease less that, every holder may have expired.
            self._recovering |= time.monotonic() - self._failing_since >= self.lease_ms / 1000 - 1.0
            self._failing_since = None
        return out

    def _drop_connections(self) -> None:
        """Pooled connections to a Redis that went away look healthy until used: drop them all, or they fail one
        by one after Redis is back and flip the replica into its fallback again. In the background and bounded:
        closing sockets to a stopped Redis waits, and the caller must fail over within its own timeout."""
        if self._dropping is not None:
            return  # one drop at a time: every call failing in an outage would start its own
        self._dropping = asyncio.get_running_loop().create_task(self._drop())

    async def _drop(self) -> None:
        try:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.timeout_s):
                    await self.client.connection_pool.disconnect()
        finally:
            self._dropping = None

    async def acquire(self, claim: SlotClaim) -> bool:
        """One call at a time: the first goes out at once, acquires arriving meanwhile queue and are decided
        together, in order, by the next call (a burst costs one round trip per batch, not per request)."""
        if self._busy:
            future = asyncio.get_running_loop().create_future()
            self._to_acquire.append((claim, future))
            return await future
        self._busy = True
        try:
            return (await self._acquire_batch([claim]))[0]
        except StoreUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - whatever kept the answer away, the caller fails over as for an outage
            raise _unexpected(e) from e
        finally:
            if self._to_acquire:  # those that queued meanwhile go next, together; later arrivals join them
                self._acquirer = asyncio.get_running_loop().create_task(self._acquire_queued())
            else:
                self._busy = False

    async def _acquire_batch(self, claims: list[SlotClaim]) -> list[bool]:
        keys: list[str] = []
        args: list = [self.lease_ms]
        for c in claims:
            keys += self.keys(c.cls)
            args += [c.holder, repr(float(c.cost)), c.cap, repr(float(c.budget if c.budget is not None else -1))]
        return [h == 1 for h in await self._script(self._acquire, keys, args)]

    async def _acquire_queued(self) -> None:
        batch: list[tuple[SlotClaim, asyncio.Future]] = []
        try:
            while self._to_acquire:
                # A caller that gave up while queued already sent its release: its claim must not go out after it.
                batch, self._to_acquire = [(c, f) for c, f in self._to_acquire if not f.done()], []
                if not batch:
                    continue
                try:
                    held = await self._acquire_batch([c for c, _ in batch])
                except Exception as e:  # noqa: BLE001 - every queued caller must hear, or it waits for ever
                    _answer(batch, e if isinstance(e, StoreUnavailable) else _unexpected(e))
                    continue
                gone = []
                for (c, future), h in zip(batch, held):
                    if not future.done():
                        future.set_result(h)
                    elif h:  # its caller gave up during the call, and its release may have reached Redis first
                        gone.append((c.cls, c.holder))
                if gone:
                    with contextlib.suppress(StoreUnavailable):  # else its lease runs out unrenewed
                        await self.release(gone)
        finally:
            # Cancelled (the store closed): the callers of the call cut short, and those queued behind it, fail
            # over now rather than wait on futures nothing will answer.
            _answer(batch + self._to_acquire, StoreUnavailable("redis store closed"))
            self._to_acquire = []
            self._busy = False
            self._acquirer = None

    async def release(self, slots: list[tuple[str, str]]) -> None:
        keys: list[str] = []
        args: list[str] = []
        for cls, holder in slots:
            keys += self.keys(cls)
            args += [holder, cls]
        await self._call(self._release(keys=[*keys, self.channel], args=args))

    async def renew(self, held: list[tuple[str, str]]) -> list[tuple[str, str]]:
        if not held:
            return []
        keys = [key for cls, _ in held for key in self.keys(cls)]
        changed = await self._script(self._renew, keys, [self.lease_ms, *(h for _, h in held)])
        return [slot for slot, ok in zip(held, changed) if not ok]

    async def adopt(self, claims: list[SlotClaim]) -> None:
        """Record slots of requests already running, past the cap if need be (after an outage)."""
        if not claims:
            return
        keys: list[str] = []
        args: list = [self.lease_ms]
        for c in claims:
            keys += self.keys(c.cls)
            args += [c.holder, repr(float(c.cost))]
        await self._script(self._adopt, keys, args)

    async def ping(self) -> None:
        """Whether the store takes writes, not only answers: a replica demoted to read-only by a failover, or full
        under `noeviction`, answers PING but refuses every slot script (the state then flapped every second)."""
        await self._script(self._probe, [f"{self.prefix}probe"], [self.lease_ms])

    async def count(self, cls: str) -> int:
        """Slots of a class held right now, expired ones excluded (for tests and tools)."""
        t = await self._call(self.client.time())
        now_ms = t[0] * 1000 + t[1] // 1000
        return await self._call(self.client.zcount(self.keys(cls)[0], f"({now_ms}", "+inf"))

    def forget(self, cls: str) -> None:
        """Nothing to drop: nothing is kept per class in the process, and a class's keys in Redis go with its
        last holder."""

    def on_release(self, callback: Callable[[str], None]) -> None:
        self._listeners.append(callback)

    # --- completion reports between instances (server.accesslog.ReportRelay) ---

    def _reports_channel(self, instance: str) -> str:
        return f"{self.prefix}reports:{instance}"

    def relay(self, instance: str, reports: list[list], heard: Callable[[bool], None]) -> None:
        """Publish reports to the instance that admitted them. Fire and forget: while Redis is away they are lost
        and those requests end as `ended`, as without a relay. `heard` learns whether any subscriber got them."""
        task = asyncio.get_running_loop().create_task(
            self._publish(self._reports_channel(instance), reports, heard))
        self._relaying.add(task)
        task.add_done_callback(self._relaying.discard)

    async def _publish(self, channel: str, reports: list[list], heard: Callable[[bool], None]) -> None:
        receivers = 0
        with contextlib.suppress(StoreUnavailable):
            # PUBLISH answers how many subscribers got the message: none when that process is gone.
            receivers = await self._call(self.client.publish(channel, orjson.dumps(reports)))
        heard(receivers > 0)

    def on_reports(self, instance: str, callback: Callable[[list[list]], None]) -> None:
        """Hear the reports relayed to `instance` (before start())."""
        self._reports = (self._reports_channel(instance), callback)

    async def start(self) -> None:
        self._subscriber = asyncio.create_task(self._subscribe(), name="extproc-store-subscriber")

    async def close(self) -> None:
        for task in (self._acquirer, self._dropping):
            if task is not None:
                task.cancel()
        if self._subscriber is not None:
            self._subscriber.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._subscriber
        if self._owns_client:
            # redis-py leaves a pool handed to a client open for whoever made it: here, this store.
            await self.client.aclose(close_connection_pool=True)

    async def _subscribe(self) -> None:
        """Hear every replica's releases, and the reports relayed to this one; reconnect while Redis is away
        (waiters poll meanwhile)."""
        reports, on_reports = self._reports or (None, None)
        while True:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(*(c for c in (self.channel, reports) if c))
                while True:
                    # No socket timeout here: a quiet channel is normal. get_message bounds each wait itself.
                    msg = await pubsub.get_message(timeout=1.0)
                    if msg is not None and msg["type"] == "message":
                        self._deliver(msg, reports, on_reports)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure means: reconnect later
                log.debug("release channel lost (%s); resubscribing", e)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(1.0)

    def _deliver(self, msg: dict, reports: str | None, on_reports: Callable[[list[list]], None] | None) -> None:
        """One message to its handlers. A message they cannot take (anything a Redis user may publish, such as
        bytes that are not UTF-8) costs only itself: it used to drop the subscription for a second, and every
        report relayed meanwhile with it."""
        try:
            if on_reports is not None and _text(msg["channel"]) == reports:
                on_reports(_reports_of(msg["data"]))
                return
            cls = _text(msg["data"])
            for callback in self._listeners:
                callback(cls)
        except Exception as e:  # noqa: BLE001 - a stray message is not worth the channel
            log.debug("ignored a message on the store's channels (%s)", e)


def _unexpected(e: Exception) -> StoreUnavailable:
    log.warning("redis store call failed unexpectedly: %s: %s", type(e).__name__, e)
    return StoreUnavailable(f"redis call failed: {type(e).__name__}: {e}")


def _answer(waiting: list[tuple[SlotClaim, asyncio.Future]], e: StoreUnavailable) -> None:
    for _, future in waiting:
        if not future.done():
            future.set_exception(e)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _reports_of(data: bytes | str) -> list[list]:
    """A relayed batch; anything else (another version's format, a stray publish) is an empty one."""
    try:
        reports = orjson.loads(data)
    except orjson.JSONDecodeError:
        return []
    return [r for r in reports if isinstance(r, list)] if isinstance(reports, list) else []
