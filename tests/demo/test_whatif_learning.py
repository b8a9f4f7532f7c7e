"""The what-if reads answers' usage as the ext_proc does (the `learn_sample` share, and the answers of a tenant whose
tokens-per-minute bucket is refunded), so its core learns the output ratio and the cost coefficients as a running
ext_proc does. Before, it read none: its estimates stayed at the policy's configured coefficients and an output
ratio of 1 for the whole run, where the real stack's moved within the first minute."""

import yaml

from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import PolicyAdmitter, what_if

PROFILE = "h100-llama70b-awq"  # answers drawn with median ~150 tokens: well under max_tokens 512


def scenario(stream: bool, key: str = "sk-plain") -> Scenario:
    return Scenario.from_dict({
        "seed": 5, "pools": {"big": {"profile": PROFILE, "replicas": 2, "model_names": ["llama-70b"]}},
        "phases": [{"name": "only", "duration_s": 30, "rate": 0.5}], "capacity": 4.0, "client_timeout_s": 120,
        "workload": {"kinds": [{"name": "chat", "endpoint": "chat", "model": "llama-70b", "prompt_tokens": 400,
                                "max_tokens": 512, "stream": stream,
                                "headers": {"Authorization": f"Bearer {key}"}}]}})


def policy(tmp_path, learn_sample: float) -> str:
    doc = {"classes": {"interactive": {"max_concurrency": 64}}, "default_class": "interactive",
           "learn_sample": learn_sample,
           "tenants": [{"name": "plain", "api_keys": ["sk-plain"], "max_class": "interactive"},
                       {"name": "metered", "api_keys": ["sk-metered"], "max_class": "interactive",
                        "tokens_per_minute": 1_000_000}],
           "models": {"llama-70b": {"cluster": "big"}}}
    path = tmp_path / f"policy-{learn_sample}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def run(tmp_path, learn_sample: float, stream: bool = True, key: str = "sk-plain"):
    s = scenario(stream, key)
    admitter = PolicyAdmitter(policy(tmp_path, learn_sample))
    res = what_if(s, admitter, s.fleet_capacity())
    return res, admitter.core.cost_models["llama-70b"]


def test_the_what_if_learns_from_the_sampled_share_of_answers(tmp_path):
    res, model = run(tmp_path, learn_sample=0.1)
    served = sum(1 for r in res.records if r.ok)
    assert served > 40
    assert abs(model.samples - 0.1 * len(res.records)) <= 1  # every 10th request decided, as the ext_proc reads
    assert model.output_ratio < 0.9  # answers of ~150 of 512 tokens: learned down from the pessimistic 1.0


def test_without_a_sample_only_a_metered_tenants_unstreamed_answers_are_read(tmp_path):
    _, model = run(tmp_path, learn_sample=0.0)
    assert model.samples == 0 and model.output_ratio == 1.0
    _, streamed = run(tmp_path, learn_sample=0.0, key="sk-metered")
    assert streamed.samples == 0  # a refund reader does not read a stream (its usage costs a message a chunk)
    res, metered = run(tmp_path, learn_sample=0.0, stream=False, key="sk-metered")
    assert metered.samples == sum(1 for r in res.records if r.ok) and metered.output_ratio < 0.9


def test_requests_refused_for_their_key_do_not_count_towards_the_sample(tmp_path):
    # The ext_proc picks a response to read after the key is authenticated (a 401 never reaches its usage reader,
    # server/stream.py): the what-if picked before, so each refused key took a turn of the learn_sample share,
    # and a known key's requests between them were read twice as often as the ext_proc would.
    from extproc.policy.admission import AdmissionController, RequestFacts
    from extproc.policy.decision import INVALID
    from tests.conftest import FakeClock

    doc = yaml.safe_load(open(policy(tmp_path, 0.5)))
    doc["anonymous"] = {"allow": False}
    path = tmp_path / "closed.yaml"
    path.write_text(yaml.safe_dump(doc))
    admitter = PolicyAdmitter(str(path))
    admitter.core = AdmissionController(admitter.policy, clock=FakeClock())
    read = []
    for _ in range(4):
        refused = admitter.decide(RequestFacts(api_key="sk-nobody", model="llama-70b", max_tokens=10))
        assert refused.kind == INVALID and refused.status == 401
        facts = RequestFacts(api_key="sk-plain", model="llama-70b", max_tokens=10, stream=True)
        admitter.decide(facts)
        read.append(facts.reads_usage)
    assert read == [False, True, False, True]  # half of the known key's requests, as learn_sample says
