"""Many names for one model: aliases (--served-model-name) and LoRA adapters route to the model's pool and are
estimated, learned and counted as that model."""

import pytest

from extproc.policy.admission import ACCEPT, DEGRADE, INVALID, AdmissionController, RequestFacts
from extproc.policy.limits import Completion, Outcome
from extproc.policy.schema import PolicyError
from tests.conftest import make_policy

MODELS = {"llama": {"cluster": "pool_a", "aliases": ["llama-alias", "sql-lora", "chat-lora"]},
          "small": {"cluster": "pool_b", "aliases": ["small-alias"]}}


def test_an_alias_routes_to_its_models_pool_and_is_charged_as_that_model(clock):
    core = AdmissionController(make_policy(models=MODELS, tenants=[]), clock=clock)
    for name, cluster, model in (("sql-lora", "pool_a", "llama"), ("llama-alias", "pool_a", "llama"),
                                 ("small-alias", "pool_b", "small"), ("llama", "pool_a", "llama")):
        d = core.decide(RequestFacts(header_class="batch", model=name, max_tokens=100))
        assert (d.kind, d.cluster, d.charge.model) == (ACCEPT, cluster, model), name
        core.finish(d.ticket, Outcome.OK)
    assert set(core.cost_models) == {"llama", "small"}  # one cost model per base: adapters share what it learns


def test_what_an_adapter_answers_teaches_its_base_model(clock):
    core = AdmissionController(make_policy(models=MODELS, tenants=[]), clock=clock)
    before = core.cost_models["llama"].output_ratio
    for _ in range(30):
        d = core.decide(RequestFacts(header_class="batch", model="chat-lora", max_tokens=1000))
        core.usage(d.ticket, 10, 100)
        clock.advance(1.0)
        core.finish(d.ticket, Outcome.OK)
        core.report(d.ticket.id, Completion(Outcome.OK, 200, 0.1, 1.0))
    assert core.cost_models["llama"].output_ratio < before


def test_an_unknown_name_is_refused_whatever_the_aliases(clock):
    core = AdmissionController(make_policy(models=MODELS, tenants=[]), clock=clock)
    d = core.decide(RequestFacts(header_class="batch", model="pool_a"))
    assert (d.kind, d.status, d.reason) == (INVALID, 404, "unknown_model")


def test_an_adapters_class_degrades_to_the_small_model(clock):
    classes = {"interactive": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0, "on_overflow": "fallback",
                               "fallback": {"action": "degrade", "model": "small", "max_tokens": 8}}}
    core = AdmissionController(make_policy(models=MODELS, classes=classes, tenants=[]), clock=clock)
    assert core.decide(RequestFacts(model="sql-lora", max_tokens=100)).kind == ACCEPT
    d = core.decide(RequestFacts(model="sql-lora", max_tokens=100))
    assert (d.kind, d.cluster, d.fallback.model) == (DEGRADE, "pool_b", "small")


@pytest.mark.parametrize("models, error", [
    ({"llama": {"cluster": "pool_a", "aliases": ["small"]}, "small": {"cluster": "pool_b"}},
     "models.llama.aliases[0]: 'small' already names model 'small'"),
    ({"llama": {"cluster": "pool_a", "aliases": ["x"]}, "small": {"cluster": "pool_b", "aliases": ["x"]}},
     "models.small.aliases[0]: 'x' already names model 'llama'"),
    ({"llama": {"cluster": "pool_a", "aliases": [""]}}, "models.llama.aliases[0]: empty name"),
])
def test_a_name_belongs_to_one_model(models, error):
    with pytest.raises(PolicyError) as e:
        make_policy(models=models, classes={"interactive": {"max_concurrency": 1}}, tenants=[])
    assert error in e.value.errors
