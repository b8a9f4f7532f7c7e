"""How late the ext_proc's event loop runs.

Every decision, release, scrape and reload waits its turn on the one event loop, and gRPC core holds new streams
until the loop takes them, so a loop that runs late delays every decision by as much. Envoy gives up on an answer
after its `message_timeout` (0.5 s in envoy.yaml) and, with `failure_mode_allow`, sends the request on unadmitted.
CPU use says the loop is busy; lateness says how long a decision now waits for it, before any request has gone
through unadmitted. Measured the usual way: a timer's wake-up against when it was due.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

# Often enough that a stall of a few hundred milliseconds shows within a scrape, cheap enough to be free (one
# timer and one histogram observation per period).
PROBE_S = 0.1


async def probe_loop_lag(observe: Callable[[float], None], period: float = PROBE_S) -> None:
    """Until cancelled: sleep `period`, then `observe` how many seconds after its due time the loop woke up."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + period
        await asyncio.sleep(period)
        # asyncio runs a timer up to its clock's resolution early: that is no lag.
        observe(max(0.0, loop.time() - due))
