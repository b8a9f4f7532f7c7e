"""`extproc check --envoy` against real Envoy, on the generated edits of tests/unit/test_envoylint_generated.py.

Fast (in `make test`): a seeded sample of the edits and of respellings, through `envoy --mode validate`. An edit
Envoy refuses must be an error of the check (it cannot ship); a respelling (a value written as Envoy's parser also
takes it: an enum by number or in lower case, a Duration as {seconds, nanos}, a bool as a string, a list split into
nested lists) must load and leave the check's findings as they were.

Behaviour (about 15 s): each edit, placed on the first listener or on a second virtual host, loaded into real Envoy in
front of the ext_proc and two recording upstreams; a few requests per config. A request that ran on a pool
without the ext_proc's ticket, ran on another pool than the one its model is on, ran twice, or a refused one that
ran at all, is a bypass: the check must call that config an error. Respelled configs must show none and be clean.
"""

from __future__ import annotations

import copy
import http.client
import json
import random
import re
import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from envoy.extensions.filters.http.ext_proc.v3.ext_proc_pb2 import ExternalProcessor
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode

from extproc.tools import envoyconf
from extproc.tools.envoylint import BOOLS, DURATIONS, ENUMS, lint
from extproc.tools.stack import Stack, free_port
from tests.conftest import policy_file, run_upstream
from tests.unit import test_envoylint_generated as gen

HI = [{"role": "user", "content": "hi"}]  # a chat request is a list of messages: one will do

POOLS = gen.POOLS
Edit = Callable[[dict, dict, dict], None]


def _findings(cfg: dict) -> tuple[list[str], list[str]]:
    found = lint(cfg, POOLS, 2000, gen.WAIT_S)
    return found.errors, found.warnings


def _validate(cfg: dict, tmp: Path) -> tuple[bool, str]:
    path = tmp / "validate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = subprocess.run([envoyconf.envoy_binary(), "--mode", "validate", "-c", str(path), "-l", "critical"],
                         capture_output=True, text=True, timeout=60)
    why = re.search(r"error initializing configuration '[^']*': (.{0,300})", run.stdout + run.stderr)
    return run.returncode == 0, why.group(1) if why else ""


# -- respellings: the same config, each value as Envoy's parser also takes it -------------------------------------

NUMBERED = {"request_header_mode": ProcessingMode.HeaderSendMode, "request_trailer_mode": ProcessingMode.HeaderSendMode,
            "response_header_mode": ProcessingMode.HeaderSendMode,
            "response_trailer_mode": ProcessingMode.HeaderSendMode, "request_body_mode": ProcessingMode.BodySendMode,
            "response_body_mode": ProcessingMode.BodySendMode, "route_cache_action": ExternalProcessor.RouteCacheAction}
DURATION = re.compile(r"^\d+(\.\d+)?s$")


def _respelled(rng: random.Random, key: Any, value: Any) -> Any:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str) and key in NUMBERED:
        return rng.choice((NUMBERED[key].Value(value), value.lower()))
    if isinstance(value, str) and str(key).endswith(("_mode", "_action")) and value.isupper():
        return value.lower()
    if isinstance(value, str) and DURATION.match(value):
        whole, _, frac = value[:-1].partition(".")
        d = {"seconds": int(whole), "nanos": int((frac + "000000000")[:9])}
        return {k: v for k, v in d.items() if v}  # 0s: {}
    return value


def respell(rng: random.Random, cfg: dict, share: float = 0.5) -> dict:
    """A copy of `cfg` with a random `share` of its values and of its routes and mutations lists respelled."""
    cfg = copy.deepcopy(cfg)
    paths = list(gen._paths(cfg))[1:]
    for at in paths:
        parent, key = gen._at(cfg, at[:-1]), at[-1]
        if not isinstance(parent[key], (dict, list)) and rng.random() < share:
            parent[key] = _respelled(rng, key, parent[key])
    for at in reversed(paths):  # inner lists first: an outer split does not move their paths
        parent, key = gen._at(cfg, at[:-1]), at[-1]
        if key in ("routes", "mutations") and isinstance(parent[key], list) and rng.random() < share:
            cut = rng.randrange(len(parent[key]) + 1)
            parent[key] = [parent[key][:cut], [], parent[key][cut:]]
    return cfg


# -- the sample ---------------------------------------------------------------------------------------------------

def _override(name: str, level: str) -> Edit:
    return lambda cfg, hcm, vh: gen._put(level, hcm, vh, gen.OVERRIDES[name])


EDITS: dict[str, Edit] = {**gen.BYPASSES, **{f"{o} on the {level}": _override(o, level) for o in gen.OVERRIDES
                                             for level in gen.LEVELS}}


def _edited(place, edit: Edit | None, base: dict | None = None) -> dict:
    cfg = copy.deepcopy(base if base is not None else gen.BASE)
    hcm, vh, _ = place(cfg)
    if edit is not None:
        edit(cfg, hcm, vh)
    return cfg


def test_a_seeded_sample_of_edits_is_an_error_where_envoy_refuses_it_and_respellings_change_nothing(tmp_path):
    rng = random.Random(20261206)
    refused = []
    for name in rng.sample(sorted(EDITS), 8) + ["the filter after the router"]:
        place = rng.choice(gen.PLACES)
        cfg = _edited(place, EDITS[name])
        ok, why = _validate(cfg, tmp_path)
        if not ok:
            refused.append(name)
            assert _findings(cfg)[0], f"{name} ({place.__name__}): Envoy refuses it ({why}), the check passes it"
            continue
        again = respell(rng, cfg)
        assert _validate(again, tmp_path)[0], f"{name} ({place.__name__}) respelled: Envoy refuses it"
        assert _findings(again) == _findings(cfg), f"{name} ({place.__name__}): respelled, the check reads it otherwise"
    assert "the filter after the router" in refused  # the sample reaches Envoy's refusals
    base = _findings(gen.BASE)
    for n in range(6):
        cfg = respell(rng, gen.BASE)
        ok, why = _validate(cfg, tmp_path)
        assert ok, f"respelling {n}: Envoy refuses it ({why})"
        assert _findings(cfg) == base, f"respelling {n}: the check reads it otherwise than the config it spells"


def test_a_mutated_config_envoy_loads_is_one_the_check_can_read(tmp_path):
    """gen._mutate inside what the check reads (the ext_proc filter, the routes, the early header mutation): where
    Envoy loads the result, the check must not raise (`check` would call it unreadable: exit 1 on a config that
    runs)."""
    rng = random.Random(20261208)
    loaded = 0
    for n in range(14):
        cfg = copy.deepcopy(gen.BASE)
        hcm, _, _ = gen.first_listener(cfg)
        done = gen._mutate(rng, rng.choice([gen._filter(hcm)["typed_config"], hcm["route_config"],
                                            hcm["early_header_mutation_extensions"][0]]))
        ok, why = _validate(cfg, tmp_path)
        if ok:
            loaded += 1
            try:
                _findings(cfg)
            except Exception as e:  # noqa: BLE001 - the finding is that anything escapes
                pytest.fail(f"mutation {n} {done}: Envoy loads it, the check raises {e!r}")
    assert loaded >= 3  # the sample reaches configs Envoy loads


def test_a_value_envoy_refuses_in_a_field_the_check_reads_is_an_error(tmp_path):
    """gen.ODD's values put into the ext_proc filter's enum, Duration and bool fields: where Envoy refuses the
    config, the check says so (it must not read the value as unset and pass the config)."""
    rng = random.Random(20261209)
    refused = 0
    shipped = gen._filter(gen.first_listener(copy.deepcopy(gen.BASE))[0])["typed_config"]
    fields = sorted(k for k in set(ENUMS) | DURATIONS | BOOLS if k in shipped or k in shipped["processing_mode"])
    for at in fields * 2:
        cfg = copy.deepcopy(gen.BASE)
        tc = gen._filter(gen.first_listener(cfg)[0])["typed_config"]
        (tc if at in tc else tc["processing_mode"])[at] = value = copy.deepcopy(rng.choice(gen.ODD))
        ok, why = _validate(cfg, tmp_path)
        if not ok:
            refused += 1
            errors = _findings(cfg)[0]
            assert any(f".{at}: " in e for e in errors), f"{at}: {value!r}: Envoy refuses it ({why}), check: {errors}"
    assert refused >= 3


# -- behaviour through Envoy ---------------------------------------------------------------------------------------

INTERNAL = "internal.example.com"  # gen.second_virtual_host's domain


class Probe:
    """One request: where it should run (a pool, or nowhere: the ext_proc refuses it)."""

    def __init__(self, path: str, body: dict, pool: str | None, **headers: str):
        self.path, self.body, self.pool, self.headers = path, body, pool, headers


PROBES = [Probe("/v1/chat/completions", {"model": "llama-70b", "messages": HI,
                                         "max_tokens": 2}, "vllm_llama70b"),
          Probe("/v1/chat/completions", {"model": "llama-8b", "messages": HI,
                                         "max_tokens": 2}, "vllm_llama8b"),
          Probe("/v1/chat/completions", {"model": "llama-70b", "messages": HI,
                                         "max_tokens": 2}, "vllm_llama70b", **{"x-model": "llama-8b"}),
          Probe("/v1/embeddings", {"model": "llama-70b", "input": "hi"}, "vllm_llama70b"),
          Probe("/v1/chat/completions", {"model": "no-such-model", "messages": HI}, None)]


def _call(port: int, method: str, path: str, body: Any = None, headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, None if body is None else json.dumps(body),
                     {"content-type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


class EditedStack(Stack):
    """The ext_proc and Envoy, Envoy restarted with each config; listeners an edit adds moved to loopback."""

    config: dict | None = None
    ports: list[int] = []  # the listeners' ports in the config Envoy was last given

    def envoy_config(self) -> dict:
        rendered = super().envoy_config()
        cfg = copy.deepcopy(self.config) if self.config is not None else rendered
        cfg["admin"] = rendered["admin"]
        cfg["static_resources"]["clusters"] = rendered["static_resources"]["clusters"]
        self.ports = [self.listen_port] + [free_port() for _ in cfg["static_resources"]["listeners"][1:]]
        for listener, port in zip(cfg["static_resources"]["listeners"], self.ports):
            listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": port}
        return cfg

    def reload(self, cfg: dict) -> bool:
        """Envoy restarted on `cfg`; False if it does not start."""
        for proc in [p for p in self.processes if p.name == "envoy"]:
            proc.stop()
            self.processes.remove(proc)
        self.config = cfg
        try:
            self.start_envoy()
        except RuntimeError:
            return False
        return True


def _bypasses(ports: list[int], upstreams: dict[str, tuple[str, int]], host: str | None) -> list[str]:
    """What the probes saw go around admission, in words. A request counts as run where the upstream read its
    whole body and answered (`served`): with request headers SKIP, Envoy sends a refused request's headers on
    before the ext_proc's 500, and resets them, which is no generation."""
    seen: list[str] = []
    headers = {"host": host} if host else {}
    for port in ports:
        for probe in PROBES:
            for _, up in upstreams.values():
                _call(up, "POST", "/test/reset")
            _call(port, "POST", probe.path, probe.body, {**headers, **probe.headers})
            what = f"port {port} {probe.path} {probe.body['model']} {probe.headers or ''}"
            for pool, (_, up) in upstreams.items():
                stats = json.loads(_call(up, "GET", "/test/stats")[1])
                if not stats["served"]:
                    continue
                if probe.pool is None:
                    seen.append(f"{what}: refused by the ext_proc, ran on {pool}")
                elif pool != probe.pool:
                    seen.append(f"{what}: ran on {pool}, its model is on {probe.pool}")
                if stats["served"] > 1:
                    seen.append(f"{what}: ran {stats['served']} times on {pool}")
                if "x-extproc-ticket" not in {k.lower() for k in stats["last_headers"]}:
                    seen.append(f"{what}: ran on {pool} without a ticket")
    return seen


def test_every_bypass_real_envoy_lets_through_is_an_error_of_the_check(tmp_path):
    rng = random.Random(20261207)
    configs = [(f"{name} ({place.__name__})", _edited(place, EDITS[name]), place)
               for name in sorted(EDITS) for place in (gen.first_listener, gen.second_virtual_host)
               if rng.random() < 0.2 or name in gen.BYPASSES and place is gen.first_listener]
    clean = [(f"respelling {n} ({place.__name__})", respell(rng, _edited(place, None)), place)
             for n, place in enumerate((gen.first_listener, gen.second_virtual_host) * 2)]
    missed, flagged_clean, report = [], [], []
    with run_upstream() as big, run_upstream() as small:
        upstreams = {"vllm_llama70b": big, "vllm_llama8b": small}
        policy = policy_file(tmp_path, endpoints={"embeddings": True})
        with EditedStack(tmp_path / "stack", {k: [v] for k, v in upstreams.items()}, policy_path=policy) as s:
            for name, cfg, place in configs + clean:
                errors = _findings(cfg)[0]
                if not s.reload(cfg):
                    report.append(f"{name}: Envoy refuses it; check: {'error' if errors else 'PASSES'}")
                    assert errors, f"{name}: Envoy refuses it, the check passes it"
                    continue
                host = INTERNAL if place is gen.second_virtual_host else None
                seen = _bypasses(s.ports, upstreams, host)
                report.append(f"{name}: {len(seen)} bypasses; check: {len(errors)} errors")
                if seen and not errors:
                    missed.append((name, seen))
                if name.startswith("respelling") and (seen or errors):
                    flagged_clean.append((name, seen, errors))
    print("\n".join(report))
    assert not missed, f"real bypasses the check passes: {missed}"
    assert not flagged_clean, f"respellings of the shipped config that bypass or are errors: {flagged_clean}"
