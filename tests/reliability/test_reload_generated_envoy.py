"""Seeded policy reloads under load, through the real stack: Envoy (envoy/envoy.yaml rendered for loopback) +
`extproc serve` + the test upstream (tests/upstream.py: delays and streams the client asks for).

A closed loop of clients (mixed keys, class claims, models, streamed and not, some walking away) runs while ~30
policies drawn from the schema's generator (tests/unit/test_policy_generated.py: classes, tenants, keys and models
added and removed, caps up and down, fairness modes, breakers, rate limits, pool limits, shadow mode) are written
one after another, a few of them invalid, each applied on SIGHUP or by the file watch. What must hold:

- every request ends before its client's timeout, with a 200 (a whole answer; a stream up to `[DONE]`) or an
  OpenAI-style error whose `x-extproc-reason` is the body's `error.code` and whose status is that reason's; no 5xx
  but the documented ones (class_removed, higher_class_saturated, ... or a canned fallback's own status);
- every valid file is applied and every invalid one refused (extproc_config_reload_total{result},
  extproc_config_last_reload_successful, `policy reload refused` in the log), the ext_proc serving throughout;
- once the load stops, no slot, queue place, degraded slot, tenant count or pool-limit hold is left, in any class
  (removed and re-added ones too): /healthz and every such gauge of /metrics read 0;
- extproc_requests_total counts each request once: for every (class, decision) what the clients were answered,
  give or take the requests whose client walked away before the answer's headers;
- `promtool check metrics` accepts the final exposition.

The generated policies are adapted to the stack (not weakened): models routed to the stack's two pools, replicas
and Envoy admin addresses pointed at this stack, queue waits capped at 2 s so a client timeout means a hang, and
`lease_ms` and `store` left at their defaults (a 1 s lease would free a leaked slot before the test looks; a Redis
store would be opened at start).

EXTPROC_RELOAD_SEED picks another sequence; EXTPROC_RELOAD_CLIENTS and EXTPROC_RELOAD_ABORTS (the share of clients
that walk away) load it harder; EXTPROC_RELOAD_LOG_PER_S=0 logs every decision (x-request-id r<N> names a request).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import aiohttp
import yaml

from extproc.policy.reasons import REASONS
from extproc.policy.schema import Policy, PolicyError, load_policy_file
from tests.conftest import until
from tests.integration.helpers import healthz, metrics, sample, upstream_reset, upstream_stats, wait_idle
from tests.unit.test_policy_generated import HEADERS, SECRET_KEY, generate, mutate, mutate_text

SEED = int(os.environ.get("EXTPROC_RELOAD_SEED", "4601"))
RELOADS = 30
INVALID_SHARE = 0.2
BURST_SHARE = 0.15
CLIENTS = int(os.environ.get("EXTPROC_RELOAD_CLIENTS", "10"))
CLIENT_TIMEOUT_S = 10.0  # queue waits are capped at 2 s and the upstream answers within ~1 s
MAX_WAIT_MS = 2000
ABORT_SHARE = float(os.environ.get("EXTPROC_RELOAD_ABORTS", "0.1"))
STACK_POOLS = ["vllm_llama70b", "vllm_llama8b"]
# 5xx the ext_proc documents as answers to load (docs/troubleshooting.md); a canned fallback sends its own status.
DOCUMENTED_5XX = {"class_removed", "higher_class_saturated", "degraded_capacity_full", "bodies_pending",
                  "store_unavailable", "latency_breaker_open", "error_breaker_open"}
# Reasons whose status is not the table's one: the breakers' (an admission there, status 0: the request is
# degraded) refuse it with 503 under `fallback: reject`; a full degraded capacity answers as the refusal it replaced.
STATUSES = {"latency_breaker_open": {503}, "error_breaker_open": {503}, "degraded_capacity_full": {429, 503}}
MODELS = ["m0", "m1", "m2", "m0-alias", "m1/lora", "llama-70b"]
KEYS = [None, "key-0", "key-1", "key-2", SECRET_KEY, "sk-unknown"]
CLAIMS = [None, "interactive", "batch", "bulk", "gold", "free", "tier-2", "nosuch"]
# Gauges of what requests hold or wait for: all 0 once nothing runs.
HELD = ["extproc_inflight", "extproc_degraded_inflight", "extproc_queue_depth", "extproc_tenant_inflight",
        "extproc_tenant_waiting", "extproc_pool_inflight", "extproc_pool_waiting_requests"]


def _replace(node, key: str, value) -> None:
    if isinstance(node, dict):
        for k in list(node):
            if k == key:
                node[k] = value(node[k])
            else:
                _replace(node[k], key, value)
    elif isinstance(node, list):
        for v in node:
            _replace(v, key, value)


def for_the_stack(doc: dict, upstream: tuple[str, int], admin_url: str) -> dict:
    """A generated policy made to run behind this stack (see the module's docstring)."""
    clusters = sorted({m["cluster"] for m in doc["models"].values()})
    pool_of = {c: STACK_POOLS[i % len(STACK_POOLS)] for i, c in enumerate(clusters)}
    for m in doc["models"].values():
        m["cluster"] = pool_of[m["cluster"]]
    if "pools" in doc:
        pools = {}
        for c, spec in doc["pools"].items():
            if "replicas" in spec:
                spec["replicas"] = [f"{upstream[0]}:{upstream[1]}"]
            pools.setdefault(pool_of.get(c, c), spec)
        doc["pools"] = pools
    _replace(doc, "envoy_admin", lambda _: admin_url)
    _replace(doc, "max_wait_ms", lambda v: min(v, MAX_WAIT_MS) if isinstance(v, int) else v)
    doc.pop("store", None)
    doc.pop("lease_ms", None)
    return doc


def draw_policy(rng: random.Random, upstream, admin_url: str, invalid: bool) -> str:
    doc = for_the_stack(generate(rng), upstream, admin_url)
    if invalid:
        doc = mutate(rng, doc)
    text = yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)
    return mutate_text(rng, text) if invalid and rng.random() < 0.3 else text


def put_policy(path: Path, text: str) -> Policy | None:
    """Write the policy file (atomically, as the kubelet swaps a ConfigMap's files) and return what it loads as
    (None: it does not). A mutation that leaves a file valid may still have renamed a model's cluster (to "yes"),
    which Envoy answers with 503 cluster_not_found, as it should (`extproc check --envoy` is the operator's guard
    against that): such a model is routed back to one of the stack's pools before the file is put in place."""
    staged = path.with_name("next.yaml")
    staged.write_text(text, encoding="utf-8")
    try:
        policy = load_policy_file(str(staged))
    except PolicyError:
        policy = None
    if policy is not None and not all(m.cluster in STACK_POOLS for m in policy.models.values()):
        doc = yaml.safe_load(text)
        for m in doc["models"].values():
            if m.get("cluster") not in STACK_POOLS:
                m["cluster"] = STACK_POOLS[0]
        staged.write_text(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False), encoding="utf-8")
        policy = load_policy_file(str(staged))
    os.replace(staged, path)
    return policy


class Load:
    """The closed-loop clients and what they were answered."""

    def __init__(self, url: str, seed: int):
        self.url = url
        self.rng = random.Random(seed)
        self.stop = asyncio.Event()
        self.answered: Counter = Counter()  # (class, decision) of answers whose headers the client read
        self.sent = 0
        self.models = MODELS
        self.cut = 0  # clients that walked away before the headers: counted or not, under some label
        self.statuses: Counter = Counter()
        self.violations: dict[str, list] = {}  # what is wrong -> [how often, the first example]

    def serving(self, policy: Policy) -> None:
        """Most requests name a model the policy in force serves (the rest, whatever the last ones did)."""
        self.models = [*policy.models, *(a for m in policy.models.values() for a in m.aliases)]

    def request(self) -> tuple[dict, dict]:
        r = self.rng
        body = {"model": r.choice(self.models if r.random() < 0.8 else MODELS),
                "messages": [{"role": "user", "content": "hello " * r.randint(1, 50)}],
                "max_tokens": r.choice([1, 4, 16]), "stream": r.random() < 0.4}
        if r.random() < 0.2:
            body["priority"] = r.choice(CLAIMS)
        self.sent += 1
        headers = {"content-type": "application/json", "x-request-id": f"r{self.sent}",  # in the decision log
                   "x-test-delay-ms": str(r.choice([0, 20, 100, 400, 800])),
                   "x-test-token-ms": str(r.choice([0, 5, 20]))}
        key = r.choice(KEYS)
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        for h in HEADERS:  # the generator's class, objective, fairness, deadline and session headers
            if r.random() < 0.3:
                headers[h] = r.choice([c for c in CLAIMS if c] + ["chat", "offline", "s1", "s2", "500"])
        return body, headers

    async def client(self, http: aiohttp.ClientSession) -> None:
        while not self.stop.is_set():
            body, headers = self.request()
            abort_after = self.rng.uniform(0.005, 0.6) if self.rng.random() < ABORT_SHARE else None
            seen: dict = {}
            t0 = time.monotonic()
            task = asyncio.create_task(self.one(http, body, headers, seen))
            try:
                async with asyncio.timeout(abort_after if abort_after is not None else CLIENT_TIMEOUT_S):
                    await asyncio.shield(task)
            except aiohttp.ClientError as e:
                self.violation(type(e).__name__, f"{e!r} after {time.monotonic() - t0:.2f} s: {body} {headers}")
            except TimeoutError:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                if abort_after is None:
                    self.violation(f"no answer within {CLIENT_TIMEOUT_S} s", f"{body} {headers}")
                if "label" in seen:
                    self.answered[seen["label"]] += 1
                else:
                    self.cut += 1

    async def one(self, http, body: dict, headers: dict, seen: dict) -> None:
        async with http.post(f"{self.url}/v1/chat/completions", data=json.dumps(body), headers=headers) as r:
            seen["label"] = (r.headers.get("x-extproc-class") or "unclassified", r.headers.get("x-extproc-decision"))
            raw = await r.read()
        self.answered[seen.pop("label")] += 1
        self.statuses[r.status, r.headers.get("x-extproc-reason", "")] += 1
        problem = self.check(r.status, r.headers, raw)
        if problem:
            self.violation(problem, f"{r.status} {dict(r.headers)} {raw[:300]!r} for {body} {headers}")

    def violation(self, what: str, example: str) -> None:
        self.violations.setdefault(what, [0, example])[0] += 1

    @staticmethod
    def check(status: int, headers, raw: bytes) -> str | None:
        canned = headers.get("x-extproc-degraded", "").startswith("canned")
        if headers.get("x-extproc-decision") is None:
            return "an answer the ext_proc did not decide"
        if status == 200 or (canned and status < 300):  # a canned fallback's answer has the policy's 2xx status
            if "text/event-stream" in headers.get("content-type", ""):
                return None if raw.rstrip().endswith(b"data: [DONE]") else "a stream cut short"
            try:
                doc = json.loads(raw)
            except ValueError:
                return "a 200 that is not JSON"
            return None if "choices" in doc or "output" in doc else "a 200 without choices"
        try:
            err = json.loads(raw)["error"]
            code, message = err["code"], err["message"]
        except (ValueError, KeyError, TypeError):
            return "an error that is not OpenAI-style JSON"
        reason = headers.get("x-extproc-reason", code if canned else None)
        if reason != code or not message:
            return "x-extproc-reason is not the error's code"
        if reason not in REASONS:
            return "an undocumented reason"
        if canned:
            return None
        if status not in STATUSES.get(reason, {REASONS[reason].status}):
            return f"status {status} for {reason}"
        if status >= 500 and reason not in DOCUMENTED_5XX:
            return "an undocumented 5xx"
        return None


async def test_generated_reloads_under_load_lose_nothing(make_stack, tmp_path, upstream):
    rng = random.Random(SEED)
    path = tmp_path / "policy.yaml"
    # The stack needs its admin URL before the first policy names it: a placeholder, replaced by the first reload.
    first = for_the_stack(generate(rng), upstream, "http://127.0.0.1:9")
    policy = put_policy(path, yaml.safe_dump(first, allow_unicode=True, sort_keys=False))
    assert policy is not None, "the generator's first policy does not load"
    s = make_stack(path, extproc_args=["--watch-interval", "0.25", "--log-decisions-per-s",
                                       os.environ.get("EXTPROC_RELOAD_LOG_PER_S", "2")])
    proc = s.process("extproc")
    load = Load(s.url, SEED)
    load.serving(policy)
    expected = Counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        async def reload_counts() -> tuple[float, float, float]:
            ms = await metrics(http, s.metrics_url)
            return (sample(ms, "extproc_config_reload_total", result="applied"),
                    sample(ms, "extproc_config_reload_total", result="invalid"),
                    sample(ms, "extproc_config_last_reload_successful"))

        async def reload_all() -> float:
            started = time.monotonic()
            for i in range(RELOADS):
                await asyncio.sleep(rng.uniform(0.2, 0.8))
                before = await reload_counts()  # before the write: the file watch may apply it at once
                # Now and then a burst: files written and signalled back to back, the last one's policy must win
                # (the reloads asked for the others may all read the last file).
                for _ in range(rng.choice([2, 3]) if rng.random() < BURST_SHARE else 1):
                    invalid = i > 0 and rng.random() < INVALID_SHARE
                    policy = put_policy(path, draw_policy(rng, upstream, s.admin_url, invalid))
                    valid = policy is not None
                    if rng.random() < 0.7:
                        os.kill(proc.popen.pid, signal.SIGHUP)  # else the file watch finds it
                expected["applied" if valid else "invalid"] += 1
                counts = await until(reload_counts, timeout=5.0,
                                     holds=lambda c: c[0] + c[1] > before[0] + before[1] and c[2] == valid)
                assert counts[2] == valid and counts[0] + counts[1] > before[0] + before[1], \
                    (i, valid, before, counts, proc.tail())
                assert proc.alive(), proc.tail()
                if valid:  # the classes of the file now serve
                    classes = await until(lambda: healthz(http, s.metrics_url), timeout=5.0,
                                          holds=lambda h: set(policy.classes) <= set(h["classes"]))
                    assert set(policy.classes) <= set(classes["classes"]), (i, policy.classes, classes)
                    load.serving(policy)
            return time.monotonic() - started

        await upstream_reset(http, upstream)
        clients = [asyncio.create_task(load.client(http)) for _ in range(CLIENTS)]
        try:
            reloading_s = await reload_all()
        finally:  # the clients stop, whatever failed
            load.stop.set()
            await asyncio.gather(*clients)

        assert not load.violations, "\n".join(f"{k} (x{n}), e.g. {e}" for k, (n, e) in load.violations.items())
        assert proc.alive(), proc.tail()
        ok, invalid, _ = await reload_counts()
        assert ok >= expected["applied"] and invalid >= expected["invalid"], (ok, invalid, expected)
        assert proc.log_path.read_text().count("policy reload refused") >= expected["invalid"]

        snap = await wait_idle(http, s.metrics_url, timeout=5.0)
        assert all(c["inflight"] == c["queue"] == c.get("degraded_inflight", 0) == 0 for c in snap.values()), snap

        def held(ms: dict) -> dict:
            return {(n, tuple(sorted(ls))): v for (n, ls), v in ms.items() if n in HELD and abs(v) > 1e-9}

        async def counted() -> Counter:
            ms = await metrics(http, s.metrics_url)
            out = Counter()
            for (n, ls), v in ms.items():
                if n == "extproc_requests_total":
                    labels = dict(ls)
                    out[labels["class"], labels["decision"]] += int(v)
                    out["total"] += int(v)
            return out

        ms = await until(lambda: metrics(http, s.metrics_url), timeout=5.0, holds=lambda ms: not held(ms))
        assert not held(ms), held(ms)
        answered = sum(load.answered.values())
        got = await until(counted, timeout=5.0, holds=lambda c: c["total"] >= answered)
        over = {k: (got[k], n) for k, n in load.answered.items() if got[k] < n}
        assert not over, f"answered more than counted: {over}"
        extra = {k: (v, load.answered[k]) for k, v in got.items() if k != "total" and v > load.answered[k]}
        assert got["total"] - answered <= load.cut, (got["total"], answered, load.cut, extra)
        # Each admission (a ticket) ends once, counted once by how it ended, none by the lease's safety net; each
        # completion report of Envoy's finds its ticket.
        ms = await metrics(http, s.metrics_url)
        admitted = sum(v for (n, ls), v in ms.items() if n == "extproc_requests_total"
                       and dict(ls)["decision"] in ("accept", "degrade")) - sample(ms, "extproc_canned_responses_total")
        ended = await until(lambda: metrics(http, s.metrics_url), timeout=5.0,
                            holds=lambda ms: sample(ms, "extproc_request_duration_seconds_count") >= admitted)
        assert sample(ended, "extproc_request_duration_seconds_count") == admitted
        assert sample(ended, "extproc_request_duration_seconds_count", outcome="lease_expired") == 0
        assert sample(ended, "extproc_completion_reports_total", result="unmatched") == 0
        assert sample(ended, "extproc_stream_errors_total") == 0
        # Nothing reached a replica without admission, during a reload or otherwise.
        assert sample(ended, "extproc_unadmitted_requests_total") == 0
        assert (await upstream_stats(http, upstream))["unticketed"] == 0
        async with http.get(f"{s.metrics_url}/metrics") as r:
            text = await r.text()
    print(f"seed {SEED}: {dict(expected)} reloads in {reloading_s:.1f} s; answers {dict(load.statuses)}, "
          f"{load.cut} cut before the headers; counted {got['total']}")
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stdout + check.stderr
    served = sum(n for (status, _), n in load.statuses.items() if status == 200)
    assert answered > 100 and served > 10, (load.statuses, reloading_s)  # the load was a load
    assert expected["invalid"] >= 2, expected
