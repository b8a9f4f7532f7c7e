"""LoRA adapters in a scenario's pool (`pools.<name>.lora_modules`, `max_loras`): the replicas serve them as
`extproc sim --lora-modules NAME=PATH --max-loras N` does (vLLM's --enable-lora), and the what-if's engine models
schedule them under the same --max-loras budget, each adapter's requests with its own lora id. Before, a scenario
could not say so: a multi-LoRA deployment (one base model, many customer adapters) had to list the adapters as
served names, which vLLM batches without any adapter budget, so the what-if never showed an adapter waiting."""

import pytest
import yaml

from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import what_if
from extproc.tools.sim.engine import Engine

ADAPTERS = [f"cust-{i}" for i in range(1, 7)]


def doc(max_loras=2) -> dict:
    pool = {"profile": "h100-llama8b", "replicas": 1, "model_names": ["llama-8b"], "lora_modules": list(ADAPTERS)}
    if max_loras is not None:
        pool["max_loras"] = max_loras
    kinds = [{"name": a, "weight": 1.0, "endpoint": "chat", "model": a, "prompt_tokens": {"min": 100, "max": 200},
              "max_tokens": 64, "stream": True, "headers": {"Authorization": f"Bearer sk-{a}"}} for a in ADAPTERS]
    return {"name": "lora", "description": "six adapters on one replica", "seed": 5,
            "pools": {"vllm_llama8b": pool}, "capacity": 20.0,
            "phases": [{"name": "calm", "duration_s": 6, "rate": 0.5}, {"name": "spike", "duration_s": 6, "rate": 1.5}],
            "slo": {"class": "interactive", "kinds": list(ADAPTERS), "p95_s": 2.0},
            "workload": {"kinds": kinds}}


POLICY = {
    "classes": {"interactive": {"max_concurrency": 64, "max_queue": 40, "max_wait_ms": 300, "slo_p95_ms": 2000,
                                "fairness": {"mode": "fair"}}},
    "default_class": "interactive",
    "pools": {"vllm_llama8b": {"limit": {"enabled": True}}},
    "tenants": [{"name": a, "api_keys": [f"sk-{a}"]} for a in ADAPTERS],
    "models": {"llama-8b": {"cluster": "vllm_llama8b", "aliases": list(ADAPTERS)}},
}


def policy(tmp_path) -> str:
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(POLICY, sort_keys=False))
    return str(path)


def test_a_pool_reads_its_adapters_and_max_loras():
    pool = Scenario.from_dict(doc()).pools[0]
    assert pool.lora_modules == ADAPTERS and pool.max_loras == 2
    assert Scenario.from_dict(doc(max_loras=None)).pools[0].max_loras == 1  # vLLM's default
    s = Scenario.from_dict(doc())
    assert all(s.serving(k) == [s.pools[0]] for k in s.workload.kinds)
    bad = doc()
    bad["pools"]["vllm_llama8b"]["max_loras"] = 0
    with pytest.raises(ValueError, match="pools.vllm_llama8b.max_loras"):
        Scenario.from_dict(bad)
    bad = doc()
    bad["pools"]["vllm_llama8b"]["lora_modules"] = "cust-1"
    with pytest.raises(ValueError, match="pools.vllm_llama8b.lora_modules"):
        Scenario.from_dict(bad)
    bad = doc()
    del bad["pools"]["vllm_llama8b"]["lora_modules"]
    with pytest.raises(ValueError, match="pools.vllm_llama8b.max_loras"):  # without adapters LoRA is off
        Scenario.from_dict(bad)


def test_adapter_requests_reach_the_engine_with_their_own_lora_id_under_max_loras(tmp_path, monkeypatch):
    seen = []
    add = Engine.add_request

    def spy(self, *args, lora: int = 0, **kwargs):
        seen.append((self.max_loras, lora))
        return add(self, *args, lora=lora, **kwargs)

    monkeypatch.setattr(Engine, "add_request", spy)
    res = what_if(Scenario.from_dict(doc()), policy(tmp_path), 20.0)
    assert seen and {m for m, _ in seen} == {2}
    assert {lora for _, lora in seen} == set(range(1, len(ADAPTERS) + 1))
    assert not [r for r in res.records if r.status == 404]


def test_the_what_if_scrape_reads_the_deferred_as_the_replicas_metrics_give_them(tmp_path, monkeypatch):
    from extproc.server.saturation import PoolScraper
    deferred = []
    record = PoolScraper.record

    def spy(self, replica, m, *args, **kwargs):
        deferred.append(m.get("deferred"))
        return record(self, replica, m, *args, **kwargs)

    monkeypatch.setattr(PoolScraper, "record", spy)
    what_if(Scenario.from_dict(doc(max_loras=1)), policy(tmp_path), 20.0)
    assert deferred and None not in deferred and max(deferred) > 0


def test_the_demo_starts_a_lora_pool_with_its_adapters_and_max_loras(pool_argv):
    argv = pool_argv("p", "h100-llama8b", 1, ["llama-8b"], 1.0, 0, lora_modules=["cust-1", "cust-2"], max_loras=4)
    at = argv.index("--lora-modules")
    assert argv[at + 1:at + 3] == ["cust-1=/adapters/cust-1", "cust-2=/adapters/cust-2"]
    assert argv[argv.index("--max-loras") + 1] == "4"
    argv = pool_argv("p", "h100-llama8b", 1, ["llama-8b"], 1.0, 0)
    assert "--lora-modules" not in argv and "--max-loras" not in argv


def test_the_policy_steers_each_adapter_to_a_replica_running_it(tmp_path, monkeypatch):
    """The what-if's scrape gives the ext_proc each replica's adapters (vllm:lora_requests_info) and its listing the
    adapters (cards with a parent): adapter requests name a replica (policy.steering), and more of them reach a
    replica already running their adapter than with Envoy's least request alone, which spreads all six over both."""
    from extproc.policy.admission import AdmissionController
    two = doc(max_loras=2)
    two["pools"]["vllm_llama8b"]["replicas"] = 2
    named, joined = [], []
    replicas_for = AdmissionController.replicas_for

    def spy(self, cluster, cls=None, model=None):
        out = replicas_for(self, cluster, cls, model)
        named.append((model, out))
        return out

    add = Engine.add_request

    def where(self, *args, lora: int = 0, **kwargs):
        joined.append(any(s.lora == lora for s in self.running))
        return add(self, *args, lora=lora, **kwargs)

    monkeypatch.setattr(AdmissionController, "replicas_for", spy)
    monkeypatch.setattr(Engine, "add_request", where)
    what_if(Scenario.from_dict(two), policy(tmp_path), 20.0)
    assert named and all(model in ADAPTERS for model, _ in named)
    assert sum(out is not None for _, out in named) > 0.9 * len(named)  # all but those before the first scrape
    assert all(out is None or out.startswith("vllm_llama8b/") and "," not in out for _, out in named)
    with_steering = sum(joined) / len(joined)
    joined.clear()
    monkeypatch.setattr(AdmissionController, "replicas_for", lambda self, cluster, cls=None, model=None: None)
    what_if(Scenario.from_dict(two), policy(tmp_path), 20.0)
    assert with_steering > 2 * sum(joined) / len(joined)  # 14% against 5% (seed 5)
