"""Security through real Envoy: spoofed priorities are demoted and counted, API keys never reach logs or metric
labels, metric label values come only from config, and the admin/metrics ports listen on loopback by default."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import string

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
import yaml

from extproc.server.main import add_arguments
from extproc.tools import envoyconf
from tests.conftest import policy_file
from tests.integration.helpers import chat, metrics, post, sample, sample_once

SECRET = "sk-live-S3CRET-acme-7f3a9c"        # a configured key
STRANGER = "sk-live-STRANGER-0b1e2d"          # a key nobody owns


def security_policy(tmp_path):
    return policy_file(tmp_path, classes={
        "interactive": {"max_concurrency": 2, "max_queue": 0, "max_wait_ms": 0},
        "batch": {"max_concurrency": 2, "max_queue": 0, "max_wait_ms": 0},
        "internal": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0}},
        tenants=[{"name": "acme", "api_keys": [SECRET], "max_class": "batch", "default_class": "batch"}],
        anonymous={"max_class": "batch", "default_class": "batch"}, shed={})


async def test_spoofed_priority_is_demoted_and_counted_and_keys_never_leak(make_stack, tmp_path):
    s = make_stack(security_policy(tmp_path), extproc_args=["--log-level", "DEBUG"])
    acme = {"authorization": f"Bearer {SECRET}"}
    async with aiohttp.ClientSession() as http:
        # Classes rank in policy order (interactive > batch > internal): acme may use batch and below.
        claims = [({**acme, "x-priority": "interactive"}, chat(), "batch"),
                  (acme, chat(priority="interactive"), "batch"),
                  ({**acme, "x-priority": "internal"}, chat(), "internal"),   # a lower class: allowed as is
                  (acme, chat(priority="internal"), "internal")]
        for headers, body, cls in claims:
            status, hs, _ = await post(http, s.url, body, headers)
            assert status == 200 and hs["x-extproc-class"] == cls
        # Rejections, invalid bodies and unknown models with both keys, so every log path sees them.
        for key in (SECRET, STRANGER):
            auth = {"authorization": f"Bearer {key}", "x-priority": "interactive"}
            burst = await asyncio.gather(*[post(http, s.url, chat(), {**auth, "x-test-delay-ms": "300"})
                                           for _ in range(4)])
            assert 429 in [st for st, _, _ in burst]
            assert (await post(http, s.url, b"{bad", auth))[0] == 400
            assert (await post(http, s.url, chat(model=key), auth))[0] == 404   # the key as a model name
        # 2 spoofs + 4 burst + 1 unknown model (a body refused before classification is not counted)
        assert await sample_once(http, s.metrics_url, "extproc_class_demotions_total", 7, tenant="acme") == 7
        assert await sample_once(http, s.metrics_url, "extproc_class_demotions_total", 5, tenant="anonymous") == 5
        async with http.get(f"{s.metrics_url}/metrics") as r:
            exposition = await r.text()
    s.stop()  # flush and close the logs
    logs = {p.name: p.read_text(errors="replace") for p in s.workdir.glob("*.log")}
    assert "429" in logs["extproc.log"] or "reject" in logs["extproc.log"]  # the log did record rejections
    for key in (SECRET, STRANGER):
        assert key not in exposition
        for name, text in logs.items():
            assert key not in text, f"{key} leaked into {name}"


async def test_metric_labels_come_only_from_config(make_stack, tmp_path):
    s = make_stack(security_policy(tmp_path))
    rng = random.Random(4)
    junk = ["zq" + "".join(rng.choices(string.ascii_lowercase + string.digits, k=10)) for _ in range(120)]
    async with aiohttp.ClientSession() as http:
        async def one(i: int):
            model = junk[i] if i % 3 == 0 else "llama-70b"
            headers = {"x-priority": junk[(i + 1) % len(junk)], "x-session-id": junk[(i + 2) % len(junk)],
                       "authorization": f"Bearer {junk[(i + 3) % len(junk)]}", "x-request-id": junk[i]}
            body = chat(model=model, priority=junk[(i + 4) % len(junk)]) if i % 2 else chat(model=model)
            return (await post(http, s.url, body, headers))[0]

        statuses = await asyncio.gather(*[one(i) for i in range(120)])
        assert set(statuses) <= {200, 404, 429}
        served = statuses.count(200)  # every completion reported (with its labels) before the labels are read
        assert await sample_once(http, s.metrics_url, "extproc_request_duration_seconds_count", served,
                                 outcome="ok") == served
        async with http.get(f"{s.metrics_url}/metrics") as r:
            text = await r.text()
    assert not [j for j in junk if j in text], "a client-chosen string became a metric label value"
    allowed = {"class": {"interactive", "batch", "internal", "unclassified"}, "tenant": {"acme", "anonymous"},
               "pool": {"vllm_llama70b", "vllm_llama8b"}, "model": {"llama-70b", "llama-8b"}}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            for label, values in allowed.items():
                if label in smp.labels:
                    assert smp.labels[label] in values, (smp.name, smp.labels)


async def test_a_huge_client_request_id_is_not_copied_whole_into_the_decision_log(make_stack, tmp_path):
    # Envoy keeps a client's x-request-id (up to its 60 KiB of headers) and every refusal's log line carries it:
    # 20 unknown-model requests with a 50,000-character id wrote 1 MB of log, 50 KB a line, so a client could
    # turn the decision log budget (lines per second) into megabytes per second. Kept: the first 256 characters.
    s = make_stack(security_policy(tmp_path))
    rid = "r" * 50_000
    async with aiohttp.ClientSession() as http:
        for _ in range(5):
            assert (await post(http, s.url, chat(model="no-such-model"), {"x-request-id": rid}))[0] == 404
    s.stop()  # flush and close the logs
    lines = [line for line in (s.workdir / "extproc.log").read_text().splitlines() if "extproc.decisions" in line]
    assert len(lines) == 5
    logged = [json.loads(line[line.index("{"):])["request_id"] for line in lines]
    assert logged == [rid[:256]] * 5


def test_admin_and_metrics_listen_on_loopback_by_default():
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--policy", "policies/default.yaml"])
    assert args.grpc[0] == "127.0.0.1" and args.metrics[0] == "127.0.0.1"
    shipped = yaml.safe_load(open("envoy/envoy.yaml"))
    assert shipped["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    local = envoyconf.render(envoyconf.load_source(), listen_port=1, admin_port=2, extproc=("127.0.0.1", 3),
                             pools={"vllm_llama70b": [("127.0.0.1", 4)], "vllm_llama8b": [("127.0.0.1", 5)]})
    assert local["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
