"""The models' clusters against Envoy's admin (extproc.server.clusters): a policy that routes a model to a cluster
Envoy does not have is named in the log and the gauge until Envoy lists it, and never refused for it."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from prometheus_client import CollectorRegistry

from extproc.server.clusters import ClusterCheck
from extproc.telemetry import Telemetry
from tests.conftest import make_policy, until


async def admin(clusters: list[str] | None):
    """A fake Envoy admin whose /clusters?format=json lists `clusters` (a list the test may change); None: JSON that
    is not Envoy's (a wrong URL)."""
    async def listing(request):
        if clusters is None:
            return web.json_response({"not": "envoy"})
        return web.json_response({"cluster_statuses": [{"name": c, "host_statuses": []} for c in clusters]})

    app = web.Application()
    app.router.add_get("/clusters", listing)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}/"


def policy(*admins: str, cluster: str = "pool_a"):
    """CORE's two models (llama -> `cluster`, small -> pool_b), pool_b read through `admins`."""
    pools = {"pool_b": {"envoy_admin": admins[0]}} if admins else {}
    models = {"llama": {"cluster": cluster}, "small": {"cluster": "pool_b"}}
    if len(admins) > 1:
        pools[cluster] = {"envoy_admin": admins[1]}
    return make_policy(models=models, pools=pools)


async def test_a_cluster_envoy_lacks_is_named_until_envoy_lists_it(caplog):
    listed = ["pool_b", "extproc"]
    runner, url = await admin(listed)
    seen = []
    check = ClusterCheck(seen.append, every_s=0.05)
    try:
        with caplog.at_level(logging.INFO, "extproc.clusters"):
            await check.configure(policy(url, cluster="yes"))
            assert await until(lambda: seen) and seen[0] == {"yes"}
            assert "clusters Envoy (admin http://127.0.0.1:" in caplog.text
            assert "does not have: yes;" in caplog.text and "(models: llama)" in caplog.text
            await asyncio.sleep(0.2)  # read again and again: logged once, not once a round
            assert caplog.text.count("does not have") == 1 and set(map(frozenset, seen)) == {frozenset({"yes"})}
            listed.append("yes")  # an operator adds the cluster to Envoy: no reload needed
            assert await until(lambda: seen[-1] == set())
            assert "Envoy now has every cluster the policy routes to (was missing: yes)" in caplog.text
    finally:
        await check.stop()
        await runner.cleanup()


async def test_a_reload_names_what_is_still_missing_again_and_one_without_an_admin_clears_it(caplog):
    runner, url = await admin(["pool_b"])
    seen = []
    check = ClusterCheck(seen.append, every_s=60)
    try:
        with caplog.at_level(logging.WARNING, "extproc.clusters"):
            await check.configure(policy(url, cluster="yes"))
            assert await until(lambda: len(seen) == 1)
            await check.configure(policy(url, cluster="yes"))  # a reload of the same file: said again
            assert await until(lambda: len(seen) == 2)
            assert caplog.text.count("does not have: yes") == 2
        await check.configure(policy())  # no envoy_admin left: nothing known, the gauge is cleared
        assert seen[-1] == set() and check.unknown is None
    finally:
        await check.stop()
        await runner.cleanup()


async def test_every_admin_must_list_it_and_one_that_does_not_answer_says_nothing():
    a, url_a = await admin(["pool_b", "pool_a"])
    listed_b = ["pool_b"]
    b, url_b = await admin(listed_b)
    down, url_down = await admin(None)
    check = ClusterCheck(lambda unknown: None, every_s=60)
    try:
        assert await check.check(policy(url_a, url_b)) == {"pool_a"}  # one Envoy of two lacks it
        listed_b.append("pool_a")
        assert await check.check(policy(url_a, url_b)) == set()
        assert await check.check(policy(url_b, url_down)) == set()  # one that does not answer: not counted
        listed_b.remove("pool_a")
        # No admin answers: the last reading stands (not cleared, not raised).
        assert await check.check(policy(url_down, "http://127.0.0.1:1")) == set()
        assert await check.check(policy(url_b, url_down)) == {"pool_a"}
    finally:
        for r in (a, b, down):
            await r.cleanup()


def test_the_gauge_has_one_series_per_missing_cluster_and_drops_those_found():
    registry = CollectorRegistry()
    telemetry = Telemetry(registry)
    telemetry.policy_unknown_clusters({"yes", "typo"})
    assert registry.get_sample_value("extproc_policy_unknown_clusters", {"cluster": "yes"}) == 1
    assert registry.get_sample_value("extproc_policy_unknown_clusters", {"cluster": "typo"}) == 1
    telemetry.policy_unknown_clusters({"typo"})
    assert registry.get_sample_value("extproc_policy_unknown_clusters", {"cluster": "yes"}) is None
    telemetry.policy_unknown_clusters(set())
    assert registry.get_sample_value("extproc_policy_unknown_clusters", {"cluster": "typo"}) is None
