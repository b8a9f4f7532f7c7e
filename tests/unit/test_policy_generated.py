"""Policies generated from the schema's own dataclasses (seeded): every documented key with a valid value, plus one
mutation at a time. Loading either builds a Policy or raises PolicyError whose lines name a key path; `extproc
check` prints those lines, never a traceback; no error quotes an API key or a Redis password; every accepted
policy runs in the core (decide, tick, finish, apply of another policy mid-flight) and drains to zero."""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import types
import typing
from typing import Any, Literal

import pytest
import yaml

from extproc.policy import schema
from extproc.policy.admission import AdmissionController
from extproc.policy.decision import QUEUE, RequestFacts
from extproc.policy.limits import Outcome
from extproc.policy.schema import PolicyError, load_policy_file
from extproc.tools import check

SEEDS = range(120)
SECRET_KEY = "sk-SECRETKEY-0042"
SECRET_PASSWORD = "hunter2pw"
PASSWORDS = [SECRET_PASSWORD, "p@" + SECRET_PASSWORD, SECRET_PASSWORD + "/x"]
HEADERS = ["x-priority", "x-session-id", "x-objective", "x-fair", "x-deadline", "x-extra"]
_HINTS = {}


def hints(cls):
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


class Gen:
    """Valid values for a field, from its type and its doc() bounds; names drawn from the policy being built."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.classes: list[str] = []
        self.models: list[str] = []
        self.clusters: list[str] = []

    def number(self, tp, lo, hi):
        r = self.rng
        lo = 0 if lo is None else lo
        hi = (lo + 1000 if lo < 1000 else lo * 10) if hi is None else hi
        choice = r.random()
        if tp is int:
            lo_i, hi_i = math.ceil(lo), math.floor(hi)
            return lo_i if choice < 0.2 else hi_i if choice < 0.3 else r.randint(lo_i, min(hi_i, lo_i + 500))
        return float(lo) if choice < 0.2 else float(hi) if choice < 0.3 else round(r.uniform(lo, hi), 3)

    def value(self, tp, f: dataclasses.Field, path: str):
        r = self.rng
        origin = typing.get_origin(tp)
        name = f.name
        if origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if r.random() < 0.2:
                return None
            tp, origin = args[0], typing.get_origin(args[0])
        if name in ("max_class", "default_class"):
            return r.choice(self.classes)
        if name == "model" and path.endswith("fallback.model"):
            return r.choice(self.models)
        if f.metadata.get("header_name"):
            return r.choice(HEADERS)
        if origin is Literal:
            return r.choice(typing.get_args(tp))
        if dataclasses.is_dataclass(tp):
            return self.mapping(tp, path)
        if origin is list:
            return []
        if origin is dict:
            return {}
        if tp is bool:
            return r.random() < 0.5
        if tp in (int, float):
            return self.number(tp, f.metadata.get("min"), f.metadata.get("max"))
        if tp is str:
            if name == "url":
                return f"redis://user:{r.choice(PASSWORDS)}@127.0.0.1:6379/0"
            if name == "envoy_admin":
                return "http://127.0.0.1:9901"
            if name == "tokenizer":
                return None
            return r.choice(["x", "é-ü", "plain text"])
        raise AssertionError(f"{path}: no generator for {tp}")

    def mapping(self, cls, path: str, skip=()) -> dict:
        out = {}
        for f in dataclasses.fields(cls):
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if f.name in skip or (not required and self.rng.random() < 0.5):
                continue
            v = self.value(hints(cls)[f.name], f, f"{path}.{f.name}")
            if v is not None or not required:
                out[f.name] = v
        return out


def generate(rng: random.Random) -> dict:
    g = Gen(rng)
    g.classes = rng.sample(["interactive", "batch", "bulk", "gold", "free", "tier-2"], rng.randint(1, 4))
    g.models = [f"m{i}" for i in range(rng.randint(1, 3))]
    g.clusters = [f"c{i}" for i in range(rng.randint(1, len(g.models)))]
    models = {}
    for i, m in enumerate(g.models):
        spec = g.mapping(schema.ModelSpec, f"models.{m}", skip=("names_from_replicas",))
        spec["cluster"] = g.clusters[i % len(g.clusters)]
        if rng.random() < 0.3:
            spec["aliases"] = [f"{m}-alias", f"{m}/lora"]
        models[m] = spec
    classes = {}
    for c in g.classes:
        spec = g.mapping(schema.ClassSpec, f"classes.{c}", skip=("min_share",))
        spec.setdefault("max_concurrency", rng.randint(1, 4))
        spec["max_concurrency"] = min(spec["max_concurrency"], 4 if rng.random() < 0.8 else 10**6)
        fb = spec.get("fallback")
        if fb is not None and fb.get("stream") is True:
            fb["stream"] = False  # the one value a degrade takes (true is refused)
        if fb is not None and fb.get("action") != "degrade":
            for k in schema._DEGRADE_ONLY:
                fb.pop(k, None)
        if fb is not None and fb.get("action") == "degrade" and not any(fb.get(k) is not None
                                                                        for k in ("model", "max_tokens", "stream")):
            fb["max_tokens"] = 16
        ad = spec.get("adaptive")
        if ad is not None:
            if ad.get("enabled"):
                spec["slo_p95_ms"] = rng.randint(100, 5000)
            ad["raise_below"], ad["cut_at"] = 0.7, 0.9
            ad["min_limit"], ad["max_limit"] = 1, 64
        fair = spec.get("fairness")
        if fair is not None:
            fair["key"] = "tenant"
        classes[c] = spec
    policy: dict[str, Any] = {"classes": classes, "models": models}
    if rng.random() < 0.5:
        policy["default_class"] = rng.choice(g.classes)
    tenants = []
    for i in range(rng.randint(0, 3)):
        t = g.mapping(schema.TenantSpec, f"tenants[{i}]", skip=("name", "api_keys", "max_class", "default_class",
                                                                 "guaranteed_share"))
        t["name"] = f"t{i}"
        t["api_keys"] = [f"key-{i}", SECRET_KEY] if i == 0 else [f"key-{i}"]
        rank = sorted(rng.sample(range(len(g.classes)), min(2, len(g.classes))))
        if rng.random() < 0.5:
            t["max_class"] = g.classes[rank[0]]
            t["default_class"] = g.classes[rank[-1]]
        tenants.append(t)
    if tenants:
        policy["tenants"] = tenants
    if rng.random() < 0.5:
        anon = g.mapping(schema.AnonymousSpec, "anonymous", skip=("max_class", "default_class"))
        if rng.random() < 0.5:
            anon["max_class"] = anon["default_class"] = g.classes[-1]
        policy["anonymous"] = anon
    if rng.random() < 0.5:
        policy["endpoints"] = g.mapping(schema.EndpointsSpec, "endpoints")
    if rng.random() < 0.5:
        headers = rng.sample(HEADERS, 5)
        cl = {"header": headers[0], "objective_header": headers[1], "deadline_header": headers[2],
              "body_field": "priority", "objectives": {"chat": g.classes[0], "offline": g.classes[-1]}}
        if rng.random() < 0.5:
            cl["fairness_header"] = headers[3]
            for c in classes.values():
                c.setdefault("fairness", {})
                c["fairness"].update(key="header", mode=rng.choice(["fair", "round_robin"]))
        policy["classify"] = cl
        policy["sessions"] = {**g.mapping(schema.SessionSpec, "sessions", skip=("header",)), "header": headers[4]}
    elif rng.random() < 0.5:
        policy["sessions"] = g.mapping(schema.SessionSpec, "sessions", skip=("header",))
    if rng.random() < 0.5:
        pools = {}
        for cl in g.clusters:
            pool = g.mapping(schema.PoolSpec, f"pools.{cl}", skip=("slow_ratio", "limit"))
            if rng.random() < 0.5:
                pool["replicas"] = ["127.0.0.1:8000", "[::1]:8001"]
            if rng.random() < 0.6:
                lim = g.mapping(schema.PoolLimitSpec, f"pools.{cl}.limit", skip=("initial", "min", "max"))
                lim["min"], lim["max"] = 1, rng.choice([4, 100, 10_000])
                pool["limit"] = lim
            pools[cl] = pool
        policy["pools"] = pools
        if rng.random() < 0.5:
            for c in classes.values():
                c["min_share"] = round(1 / (len(classes) + 1), 3)
    if rng.random() < 0.3:
        policy["shed"] = {g.classes[0]: g.classes[1:]} if rng.random() < 0.7 else {}
    for key in ("fleet", "store"):
        if rng.random() < 0.4:
            policy[key] = g.mapping(getattr(schema, {"fleet": "FleetSpec", "store": "StoreSpec"}[key]), key)
    for f in dataclasses.fields(schema.Policy):
        if f.name in ("learn_sample", "mode", "lease_ms", "sustained_window_s", "retry_after_max_s") \
                and rng.random() < 0.4:
            policy[f.name] = g.value(hints(schema.Policy)[f.name], f, f.name)
    return policy


# --- mutations: one change to a generated policy ---------------------------------------------------------------

WRONG = [0, -1, 10**30, 10**400, float("nan"), float("inf"), float("-inf"), "", [], {}, "yes", True, None,
         "ünï\u0000", [[]], {"a": 1}, 1.5, "12", -0.0]


def paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in list(node.items()):
            yield from paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths(v, (*prefix, i))


def set_at(doc, path, value):
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


def mutate(rng: random.Random, policy: dict) -> dict:
    """One mutation: a wrong or boundary value somewhere, a duplicate, a dangling reference, a missing key."""
    all_paths = [p for p in paths(policy) if p]
    kind = rng.randrange(8)
    if kind <= 2:
        set_at(policy, rng.choice(all_paths), rng.choice(WRONG))
    elif kind == 3:  # a dangling reference
        where = rng.choice([("default_class",), ("anonymous",), ("shed",), ("tenants",), ("classes",)])
        if where == ("default_class",):
            policy["default_class"] = "nosuch"
        elif where == ("anonymous",):
            policy.setdefault("anonymous", {})["max_class"] = "nosuch"
        elif where == ("shed",):
            policy["shed"] = {"nosuch": list(policy["classes"])}
        elif where == ("tenants",):
            policy.setdefault("tenants", []).append({"name": "x", "api_keys": ["kx"], "default_class": "nosuch"})
        else:
            c = next(iter(policy["classes"].values()))
            c["fallback"] = {"action": "degrade", "model": "nosuch"}
    elif kind == 4:  # duplicates
        tenants = policy.setdefault("tenants", [])
        tenants.append({"name": "dup", "api_keys": [SECRET_KEY]})
        tenants.append({"name": "dup", "api_keys": [SECRET_KEY, f"  {SECRET_KEY}", f"{SECRET_KEY},x", ""]})
    elif kind == 5:  # delete a key
        path = rng.choice(all_paths)
        node = policy
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]
    elif kind == 6:  # a value of the wrong shape at a container
        containers = [p for p in all_paths if isinstance(_get(policy, p), (dict, list))]
        set_at(policy, rng.choice(containers), rng.choice([1, "x", [1], {"k": "v"}, None]))
    else:  # a secret where it does not belong
        policy["store"] = {"kind": "redis", "url": rng.choice([f"http://u:{pw}@h:1/" for pw in PASSWORDS])}
        policy.setdefault("tenants", []).append({"name": "s", "api_keys": [{"key": SECRET_KEY}, 5, [SECRET_KEY]]})
    return policy


def _get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


TEXT_CASES = [
    # YAML anchors and merge keys, booleans written as yes/on, .nan/.inf, duplicate keys, an alias bomb
    "base: &b {max_concurrency: 2, max_queue: 1}\nclasses:\n  a: {<<: *b, max_wait_ms: 10}\n  b: *b\n"
    "models: {m: {cluster: c}}\nbase2: 1\n",
    "classes:\n  a: {max_concurrency: 2, shadow: yes, early_reject: on}\nmodels: {m: {cluster: c}}\n",
    "classes:\n  a: {max_concurrency: 2, max_wait_ms: .nan}\nmodels: {m: {cluster: c}}\n",
    "classes:\n  a: {max_concurrency: .inf}\nmodels: {m: {cluster: c}}\n",
    "classes:\n  a: {max_concurrency: 1}\n  a: {max_concurrency: 2}\nmodels: {m: {cluster: c}}\n",
    "classes: {a: {max_concurrency: 1}}\nmodels: {m: {cluster: c}}\nlearn_sample: .NaN\n",
    "classes: {a: {max_concurrency: 1}}\nmodels: {m: {cluster: c}}\nanonymous: {allow: off}\n",
    "classes: {a: &x {max_concurrency: 1, fallback: *x}}\nmodels: {m: {cluster: c}}\n",
    "a: &a [1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
    "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nclasses: *d\nmodels: *d\n",
    f"classes: {{a: {{max_concurrency: 1}}}}\nmodels: {{m: {{cluster: c}}}}\ntenants:\n"
    f"  - {{name: t, api_keys: [{SECRET_KEY}, {SECRET_KEY}]}}\n  - {{name: u, api_keys: {{{SECRET_KEY}: 1}}}}\n",
    f"classes: {{a: {{max_concurrency: 1}}}}\nmodels: {{m: {{cluster: c}}}}\n"
    f"store: {{kind: redis, url: 'redis//:{SECRET_PASSWORD}@host:6379'}}\n",
    "classes: {a: {max_concurrency: 1}}\nmodels: {m: {cluster: c}}\n? [1, 2]\n: 3\n",
    "classes: {a: {max_concurrency: 1}}\nmodels: {m: {cluster: c}}\n1: 2\nnull: 3\n",
    "[]\n", "", "~\n", "just a string\n", "classes: {1: {max_concurrency: 1}}\nmodels: {m: {cluster: c}}\n",
    "classes: !!python/object:os.system {}\nmodels: {}\n",
    "classes: {a: {max_concurrency: 1}}\nmodels: {m: {cluster: c}}\nlease_ms: 0x10\nretry_after_max_s: 1_000\n",
    "classes: {a: {max_concurrency: 1}}\nmodels: {m: {cluster: c}}\ndefault_class: 2001-12-14\n",
]


STRAY = ["\x00", "\x1b", "\x0c", "\x7f", "\t", "\ufeff", "\x85", "\u2028", ":", "[", "{", "&", "*", "!", "%",
         "@", "`", "|", ">", "- ", "? ", "\n  ", "\n-", "'", '"', "#", "<<: 1\n"]


def mutate_text(rng: random.Random, text: str) -> str:
    """A stray character or a cut somewhere in the file (a paste gone wrong, a file half written)."""
    at = rng.randrange(len(text) + 1)
    if rng.random() < 0.3:
        return text[:at]
    return text[:at] + rng.choice(STRAY) + text[at:]


# --- the properties ----------------------------------------------------------------------------------------------

def load_checked(path: str):
    """The load either builds a Policy or raises PolicyError naming key paths and quoting no secret."""
    try:
        return load_policy_file(path)
    except PolicyError as e:
        assert e.errors, "a PolicyError with no error line"
        for line in e.errors:
            assert isinstance(line, str) and ": " in line and "\n" not in line, line
            assert SECRET_KEY not in line and SECRET_PASSWORD not in line, line
        return e


def check_cli(path: str, capsys) -> tuple[int, str]:
    code = check.run(argparse.Namespace(files=[path], envoy=None, max_body_bytes=4 << 20, max_pending_bodies=10_000))
    out = capsys.readouterr()
    text = out.out + out.err
    assert "Traceback" not in text
    assert SECRET_KEY not in text and SECRET_PASSWORD not in text, text
    return code, text


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def facts_for(rng: random.Random, policy) -> list[RequestFacts]:
    keys = [k for t in policy.tenants for k in t.api_keys] + [None, "unknown-key"]
    names = list(policy.models) + [a for m in policy.models.values() for a in m.aliases]
    claims = list(policy.classes) + [None, "NOSUCH", "Batch", ""]
    out = []
    for i in range(40):
        prompt = rng.choice(["hi", "x" * 5000, ""])
        out.append(RequestFacts(
            api_key=rng.choice(keys), header_class=rng.choice(claims), body_class=rng.choice(claims),
            model=rng.choice(names) if rng.random() < 0.9 else rng.choice(["nosuch", None]),
            max_tokens=rng.choice([None, 0, 1, 100, 10**9, 2**63]),
            stream=rng.random() < 0.5, request_id=f"r{i}", session_id=rng.choice([None, "s1", "s2"]),
            doc={"messages": [{"role": "user", "content": prompt}]} if rng.random() < 0.8 else None,
            sequences=rng.choice([1, 1, 4]), objective=rng.choice([None, "chat", "offline", "zzz"]),
            fairness_id=rng.choice([None, "f1", "f2"]), deadline_ms=rng.choice([None, 0.0, 5.0, 1e9])))
    return out


def run_core(rng: random.Random, policy, other) -> None:
    clock = Clock()
    core = AdmissionController(policy, clock=clock)
    tickets, waiters = [], []

    def take(d):
        assert d.kind in ("accept", "queue", "degrade", "reject", "shed", "invalid"), d
        if d.kind == QUEUE:
            waiters.append(d.waiter)
        elif d.ticket is not None:
            tickets.append(d.ticket)
        else:
            assert 400 <= d.status <= 599 or d.kind == "degrade", d
            assert d.message or d.kind == "degrade", d

    batch = facts_for(rng, policy)
    for i, f in enumerate(batch):
        take(core.decide(f))
        clock.t += rng.choice([0.0, 0.001, 0.05])
        if i % 7 == 0:
            core.tick()
        if i == 20 and other is not None:
            core.apply(other)  # a reload while requests are in flight and queued
        if i % 5 == 0 and tickets:
            core.finish(tickets.pop(0), rng.choice(list(Outcome)))
    # drain: end every admitted request; queued ones are granted as slots free, or time out
    for _ in range(10_000):
        for w in waiters:
            if not w.pending and w.result.ticket is not None and w.result.ticket not in tickets \
                    and w.result.ticket.id in core.tickets:
                tickets.append(w.result.ticket)
        waiters = [w for w in waiters if w.pending]
        if not tickets and not waiters:
            break
        if tickets:
            core.finish(tickets.pop(0))
        else:
            clock.t += 30.0
            core.reap()
        core.tick()
    else:
        raise AssertionError("the core never drained")
    clock.t += 120.0
    core.reap()
    for name, row in core.snapshot().items():
        assert row["inflight"] == 0 and row["queue"] == 0 and row["degraded_inflight"] == 0, (name, row)
        assert abs(row["inflight_cost"]) < 1e-6, (name, row)
    assert not core.tickets
    for name, gate in core.gates.items():
        assert abs(gate.inflight) < 1e-6 and not any(gate.count) and max(map(abs, gate.held)) < 1e-6, name
        assert not any(gate.waiting), name
    for key, s in core.sessions.sessions.items():
        assert s.inflight == 0 and s.queued == 0, key
    for lim in core.limiters.values():
        assert lim.running == 0 and lim.waiting == 0 and not lim.queue, lim.name


def write(tmp_path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return str(p)


@pytest.mark.parametrize("seed", SEEDS)
def test_generated_policy(seed, tmp_path, capsys):
    rng = random.Random(seed)
    doc = generate(rng)
    mutated = seed % 3 != 0
    if mutated:
        doc = mutate(rng, doc)
    text = yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)
    if seed % 5 == 4:
        text = mutate_text(rng, text)
    path = write(tmp_path, "p.yaml", text)
    got = load_checked(path)
    code, text = check_cli(path, capsys)
    if isinstance(got, PolicyError):
        assert code == 1 and "invalid" in text
        return
    assert code == 0, text
    other_doc = generate(random.Random(seed + 10_000))
    other = load_checked(write(tmp_path, "o.yaml", yaml.safe_dump(other_doc, allow_unicode=True, sort_keys=False)))
    run_core(rng, got, None if isinstance(other, PolicyError) else other)


def test_unmutated_policies_load(tmp_path):
    """The generator's valid policies are valid (else the mutations test little)."""
    refused = []
    for seed in range(60):
        doc = generate(random.Random(seed))
        got = load_checked(write(tmp_path, f"p{seed}.yaml", yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)))
        if isinstance(got, PolicyError):
            refused.append((seed, got.errors))
    assert not refused, refused


@pytest.mark.parametrize("i", range(len(TEXT_CASES)))
def test_yaml_text_cases(i, tmp_path, capsys):
    path = write(tmp_path, "p.yaml", TEXT_CASES[i])
    got = load_checked(path)
    code, _ = check_cli(path, capsys)
    assert code == (1 if isinstance(got, PolicyError) else 0)
    if not isinstance(got, PolicyError):
        run_core(random.Random(i), got, None)


@pytest.mark.parametrize("seed", range(0, 40, 2))
def test_generated_reload_onto_a_serving_core(seed, tmp_path, caplog):
    """`extproc serve` loads an accepted policy, then a reload of another generated file is applied when it loads
    and refused (the old policy serving on) when it does not; its log quotes no secret and holds no traceback."""
    import asyncio

    from prometheus_client import generate_latest

    from extproc.server.main import Server, add_arguments

    rng = random.Random(seed)
    first = generate(rng)
    first["store"] = {"kind": "memory"}  # a redis store would be opened at start
    path = write(tmp_path, "policy.yaml", yaml.safe_dump(first, allow_unicode=True, sort_keys=False))
    policy = load_checked(path)
    if isinstance(policy, PolicyError):
        pytest.skip("the first policy does not load")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    caplog.set_level("INFO")
    server = Server(path, policy, parser.parse_args(["--policy", path]))
    for f in facts_for(rng, policy)[:20]:
        server.core.decide(f)
    second = generate(random.Random(seed + 77))
    if seed % 4:
        second = mutate(rng, second)
    text = yaml.safe_dump(second, allow_unicode=True, sort_keys=False)
    if seed % 3 == 0:
        text = mutate_text(rng, text)
    write(tmp_path, "policy.yaml", text)
    valid = not isinstance(load_checked(path), PolicyError)

    async def reload() -> bool:
        applied = await server.reload()
        results = await asyncio.gather(*server._reload_tasks, return_exceptions=True)
        assert not [r for r in results if isinstance(r, BaseException)], results
        return applied

    assert asyncio.run(reload()) is valid
    if not valid:
        assert server.core.policy is policy
    for f in facts_for(rng, server.core.policy)[:20]:
        server.core.decide(f)
    generate_latest(server.telemetry.registry)
    assert "Traceback" not in caplog.text and not any(r.exc_info for r in caplog.records)
    assert SECRET_KEY not in caplog.text and SECRET_PASSWORD not in caplog.text
