"""What a policy reload costs the event loop, and what a SIGHUP storm does to admission answers.

In process, on uvloop, through `Server` and its servicer (no gRPC, no Envoy): streams are fed to the servicer as
grpc.aio would feed them (request headers, then the buffered body), at a steady rate, each held `--hold-ms` after
its answer and then ended; a decision's latency is the time from its headers message being read to the body's
answer being written (the servicer's own view, the part Envoy's 0.5 s `message_timeout` counts, less transport),
counted from when the request was due, so that a stalled loop, which also delays the arrivals, is not hidden.

1. `reload cost`: `--reloads` reloads one after another, nothing else running; for each, the parse in its thread
   (wall time) and the longest step of the event loop while it ran (the loop thread gets the GIL every
   sys.getswitchinterval()), then the rest of the reload on the loop (`_apply`, the change line, warnings) and the
   reconfigure tasks it starts (scrapers, clusters): their longest loop step and their sum.
   `apply cost` (with --generate): `AdmissionController.apply` alone, and the reload's change line
   (policy_changes), for a policy that differs from the running one by one tenant's API key, as the child process
   hands it over (unpickled: fresh objects, their strings not hashed yet); median of `--reloads`.
2. `decisions`: the same load `--seconds` long without reloads, then with `Server.start_reload()` (what SIGHUP
   calls) every `--every` seconds, the file unchanged (or, `--edits`, a comment added before each): p50/p99/max
   latency, the longest loop step seen by a 1 ms probe, and how many reloads were asked, applied
   (`extproc_config_reload_total`) and left pending at the end (with how long they took to drain).

Policies: any file (`--policy policies/demo-full.yaml`), or `--generate` (tenants, classes, pools with replicas
lists: what a large fleet's file looks like; the replicas are closed loopback ports, refused at once).
Run:  python bench/reload.py --policy policies/demo-full.yaml
      python bench/reload.py --generate 2000,20,10 [--edits]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pickle
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc.aio import EOF

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extproc.policy.admission import AdmissionController  # noqa: E402
from extproc.policy.changes import policy_changes  # noqa: E402
from extproc.policy.schema import load_policy, load_policy_file  # noqa: E402
from extproc.server import main  # noqa: E402
from extproc.server.main import Server, add_arguments  # noqa: E402


def generated(tenants: int, classes: int, pools: int) -> dict:
    """A large fleet's policy: `classes` classes, `tenants` tenants spread over them, one model per pool, each pool
    with four replicas listed and a limit of its own."""
    names = [f"c{i}" for i in range(classes)]
    port = closed_port()
    return {
        "classes": {n: {"max_concurrency": 1000, "max_queue": 50, "max_wait_ms": 500} for n in names},
        "default_class": names[-1],
        "tenants": [{"name": f"t{i}", "api_keys": [f"sk-{i}"], "default_class": names[i % classes],
                     "max_class": names[i % classes], "requests_per_minute": 10**9} for i in range(tenants)],
        "models": {f"m{p}": {"cluster": f"pool{p}", "aliases": [f"m{p}-a{a}" for a in range(3)]}
                   for p in range(pools)},
        "pools": {f"pool{p}": {"replicas": [f"127.0.0.1:{port}" if r == 0 else f"127.0.0.{r + 1}:{port}"
                                            for r in range(4)],
                               "scrape_interval_ms": 1000, "limit": {"enabled": True}} for p in range(pools)},
    }


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: connections to it are refused


def header_map(**headers: bytes) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in headers.items()])


class Stream:
    """grpc.aio's side of one ext_proc stream: headers, the body, then (after the answer) a hold, then EOF."""

    def __init__(self, model: str, key: str | None, hold_s: float, latencies: list[float], due: float) -> None:
        headers = {":method": b"POST", ":path": b"/v1/chat/completions", "content-type": b"application/json"}
        if key:
            headers["authorization"] = b"Bearer " + key.encode()
        body = b'{"model":"%s","max_tokens":64,"messages":[{"role":"user","content":"hi"}]}' % model.encode()
        self.script = [pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map(**headers))),
                       pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]
        self.hold_s, self.latencies = hold_s, latencies
        # When Envoy would have sent it, not when the loop got round to it: a stalled loop delays both.
        self.arrived, self.answered = due, None

    async def read(self):
        if self.script:
            return self.script.pop(0)
        await asyncio.sleep(self.hold_s)
        return EOF

    async def write(self, answer) -> None:
        if not self.script and self.answered is None:
            self.answered = time.perf_counter()
            self.latencies.append(self.answered - self.arrived)


class Probe:
    """The event loop's steps as a 1 ms timer sees them: (woke at, gap since the previous wake-up)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float]] = []

    async def run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.steps.append((now, now - last))
            last = now

    def longest(self, start: float = 0.0, end: float = float("inf")) -> float:
        """The longest step that overlapped [start, end]."""
        return max((gap for at, gap in self.steps if at > start and at - gap < end), default=0.0)


def server_for(path: str) -> Server:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--policy", path, "--watch-interval", "0"])
    return Server(path, load_policy_file(path), args)


def applied(server: Server) -> int:
    return int(server.telemetry.registry.get_sample_value("extproc_config_reload_total", {"result": "applied"}) or 0)


async def reload_cost(server: Server, reloads: int) -> dict:
    probe = Probe()
    probing = asyncio.create_task(probe.run())
    parses: list[tuple[float, float]] = []
    # What the reload runs in its thread (read_policy; load_policy_file before it remembered the applied parse).
    name = "read_policy" if hasattr(main, "read_policy") else "load_policy_file"
    real_load = getattr(main, name)

    def timed_load(*args):
        start = time.perf_counter()
        try:
            return real_load(*args)
        finally:
            parses.append((start, time.perf_counter()))

    setattr(main, name, timed_load)
    rows = []
    try:
        for i in range(reloads):
            await asyncio.sleep(0.05)
            edit(server.policy_path, i)  # new bytes: parsed, whatever the version remembers
            started = time.perf_counter()
            assert await server.reload()
            reloaded = time.perf_counter()
            await asyncio.gather(*server._reload_tasks)  # scrapers/clusters reconfigured
            done = time.perf_counter()
            await asyncio.sleep(0.005)  # the probe's step that covers the end
            p_start, p_end = parses[-1]
            rows.append({"parse_s": p_end - p_start, "loop_step_during_parse_s": probe.longest(p_start, p_end),
                         "on_loop_step_s": probe.longest(p_end, done + 0.004),
                         "after_parse_s": done - p_end, "reload_s": reloaded - started})
    finally:
        setattr(main, name, real_load)
        probing.cancel()
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} | \
        {k + "_max": max(r[k] for r in rows) for k in rows[0]}


def apply_cost(doc: dict, reloads: int) -> dict:
    """core.apply and policy_changes, on the loop for each applied reload, for one tenant's key changed."""
    core = AdmissionController(load_policy(doc))
    rows = []
    for i in range(reloads):
        edited = {**doc, "tenants": [dict(t, api_keys=[f"sk-edit-{i}"]) if j == i else t
                                     for j, t in enumerate(doc["tenants"])]}
        policy = pickle.loads(pickle.dumps(load_policy(edited)))
        before = core.policy
        start = time.perf_counter()
        core.apply(policy)
        applied_at = time.perf_counter()
        policy_changes(before, policy)
        rows.append({"core_apply_s": applied_at - start, "policy_changes_s": time.perf_counter() - applied_at})
        assert core.classifier.tenant_for(f"sk-edit-{i}").name == f"t{i}"
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def edit(path: str, i: int) -> None:
    """A change of the file that changes nothing of its policy (a comment)."""
    with open(path, "a") as f:
        f.write(f"# edit {i}\n")


async def decisions(server: Server, seconds: float, rate: float, hold_s: float, every: float | None,
                    requests: list[tuple[str, str | None]], edits: bool) -> dict:
    latencies: list[float] = []
    probe = Probe()
    probing = asyncio.create_task(probe.run())
    streams: set[asyncio.Task] = set()
    asked, applied_before = 0, applied(server)
    start = time.perf_counter()
    next_reload = start + (every or float("inf"))
    i = 0
    while (now := time.perf_counter()) - start < seconds:
        if now >= next_reload:
            if edits:
                edit(server.policy_path, asked)
            server.start_reload()  # what the SIGHUP handler calls
            asked += 1
            next_reload += every
        due = start + i / rate
        if now < due:
            await asyncio.sleep(min(due, next_reload) - now)
            continue
        model, key = requests[i % len(requests)]
        ctx = Stream(model, key, hold_s, latencies, due)
        task = asyncio.create_task(server.servicer.Process(None, ctx))
        streams.add(task)
        task.add_done_callback(streams.discard)
        i += 1
    pending = len(server._reload_tasks)
    await asyncio.gather(*streams)
    drain_start = time.perf_counter()
    while server._reload_tasks:
        await asyncio.gather(*list(server._reload_tasks))
    drained_s = time.perf_counter() - drain_start
    probing.cancel()
    q = statistics.quantiles(latencies, n=100)
    return {"requests": len(latencies), "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3,
            "max_ms": max(latencies) * 1e3, "over_50ms": sum(x > 0.05 for x in latencies),
            "over_500ms": sum(x > 0.5 for x in latencies), "longest_loop_step_ms": probe.longest() * 1e3,
            "reloads_asked": asked, "reloads_applied": applied(server) - applied_before,
            "reload_tasks_left_at_end": pending, "their_drain_s": drained_s}


def main_(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = p.add_mutually_exclusive_group(required=True)  # without either it failed on a None path
    which.add_argument("--policy", help="policy file")
    which.add_argument("--generate", metavar="TENANTS,CLASSES,POOLS", help="a generated policy instead, e.g. 2000,20,10")
    p.add_argument("--reloads", type=int, default=10)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=200.0, help="new requests a second")
    p.add_argument("--hold-ms", type=float, default=50.0)
    p.add_argument("--every", type=float, default=0.2, help="seconds between reloads in the storm")
    p.add_argument("--edits", action="store_true", help="edit the file (a comment) before each reload of the storm")
    p.add_argument("--no-uvloop", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "policy.yaml"
        if a.generate:
            t, c, n = (int(x) for x in a.generate.split(","))
            doc = generated(t, c, n)
            path.write_text(yaml.safe_dump(doc, sort_keys=False))
            requests = [(f"m{i % n}", f"sk-{i % t}") for i in range(997)]
        else:
            shutil.copy(a.policy, path)
            doc = yaml.safe_load(path.read_text())
            requests = [(next(iter(doc["models"])), None)]
        print(f"policy: {a.policy or 'generated ' + a.generate}, {path.stat().st_size} bytes; "
              f"switch interval {sys.getswitchinterval() * 1e3:g} ms")

        async def run() -> None:
            server = server_for(str(path))
            cost = await reload_cost(server, a.reloads)
            print("reload cost (median / max of %d):" % a.reloads)
            for k in ("parse_s", "loop_step_during_parse_s", "on_loop_step_s", "after_parse_s", "reload_s"):
                print(f"  {k:26s} {cost[k] * 1e3:8.1f} ms / {cost[k + '_max'] * 1e3:8.1f} ms")
            if a.generate:
                cost = apply_cost(doc, a.reloads)
                print("apply cost, one tenant's key changed (median of %d): " % a.reloads +
                      ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in cost.items()))
            for every in (None, a.every):
                r = await decisions(server, a.seconds, a.rate, a.hold_ms / 1e3, every, requests, a.edits)
                name = "no reloads" if every is None else \
                    f"reload every {every:g} s" + (", the file edited before each" if a.edits else "")
                print(f"decisions, {name}: " + ", ".join(
                    f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
            await server.scrapers.stop()
            await server.clusters.stop()

        if a.no_uvloop:
            asyncio.run(run())
        else:
            import uvloop
            uvloop.run(run())


if __name__ == "__main__":
    main_()
