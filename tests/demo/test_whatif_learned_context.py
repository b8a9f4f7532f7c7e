"""The what-if's ext_proc core learns a model's context from the simulated replicas' /v1/models as the real stack
does (policy without `cost.max_context_tokens`): under the names the scenario serves (`extproc sim --model-name`),
also for a policy pool that names no replicas (the demo fills them in, so the real stack scrapes and reads them).
Found by an audit (scenarios/audit-long-context.yaml): the listing carried the profile's own served name, which no
policy model matched, so nothing was learned and a summary asking max_tokens 32768 on a 32K-context pool weighed
its prompt + 32768 tokens in the pool limit (50K on average) where the real stack weighs the 32,768 vLLM can hold."""

import pytest

from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import PolicyAdmitter, what_if

POLICY = """
classes:
  interactive: {max_concurrency: 64, slo_p95_ms: 2000}
models:
  llama-8b: {cluster: vllm_llama8b}
pools:
  vllm_llama8b:
REPLICAS    limit: {enabled: true}
"""


@pytest.mark.parametrize("replicas", ["", "    replicas: ['10.0.0.1:8000', '10.0.0.2:8000']\n"])
def test_the_what_if_learns_the_context_the_replicas_list(tmp_path, replicas):
    (tmp_path / "policy.yaml").write_text(POLICY.replace("REPLICAS", replicas))
    scenario = Scenario.from_dict({
        "seed": 3, "capacity": 1.0, "client_timeout_s": 600,
        "pools": {"vllm_llama8b": {"profile": "scenarios/profiles/h100-llama8b-32k.yaml", "replicas": 2,
                                   "model_names": ["llama-8b"]}},
        "phases": [{"name": "only", "duration_s": 10, "rate": 1.0}],
        "workload": {"kinds": [{"name": "interactive", "model": "llama-8b", "prompt_tokens": 20000,
                                "max_tokens": 32768, "headers": {"x-priority": "interactive"}}]}})
    admitter = PolicyAdmitter(str(tmp_path / "policy.yaml"))
    weights = []
    decide = admitter.decide

    def recording(facts):
        d = decide(facts)
        if getattr(d, "ticket", None) is not None:
            weights.append(d.ticket.units)
        return d

    admitter.decide = recording
    res = what_if(scenario, admitter, 1.0)
    assert admitter.core.cost_models["llama-8b"].context_tokens == 32768  # before: None
    assert weights and max(weights) <= 32768  # before: the prompt (~20K) + 32,768
    assert all(r.ok for r in res.records if r.kind == "interactive")
