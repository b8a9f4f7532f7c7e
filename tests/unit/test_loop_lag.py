"""The event-loop lag probe (extproc/server/loop_lag.py): what a decision waits for the loop, in the histogram."""

import asyncio
import time

from extproc.server.loop_lag import probe_loop_lag
from extproc.telemetry import Telemetry


def lag_buckets(telemetry: Telemetry) -> tuple[float, float]:
    """(observations, observations over 0.25 s)."""
    r = telemetry.registry
    count = r.get_sample_value("extproc_event_loop_lag_seconds_count")
    under = r.get_sample_value("extproc_event_loop_lag_seconds_bucket", {"le": "0.25"})
    return count, count - under


def test_a_loop_held_by_blocking_work_shows_as_lag_and_an_idle_one_does_not():
    telemetry = Telemetry()

    async def run() -> None:
        probe = asyncio.create_task(probe_loop_lag(telemetry.loop_lagged, period=0.02))
        await asyncio.sleep(0.2)
        idle = lag_buckets(telemetry)
        time.sleep(0.4)  # a handler that blocks the loop (a parse, a tokenizer, a GC pause)
        await asyncio.sleep(0.1)
        probe.cancel()
        return idle

    (idle_count, idle_late) = asyncio.run(run())
    count, late = lag_buckets(telemetry)
    assert idle_count >= 3 and idle_late == 0
    assert late == 1 and telemetry.registry.get_sample_value("extproc_event_loop_lag_seconds_sum") >= 0.35
    assert count > idle_count
