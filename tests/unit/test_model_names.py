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


# --- names_from_replicas: the names a pool's replicas list in /v1/models ---

def card(name, parent=None):
    return {"id": name, "object": "model", "root": f"/models/{name}", "parent": parent}


LISTED = {"llama": {"cluster": "pool_a", "names_from_replicas": True}, "small": {"cluster": "pool_b"}}
POOLS = {"pool_a": {"replicas": ["10.0.0.1:8000"]}}


def listed_core(clock, **models):
    return AdmissionController(make_policy(models={**LISTED, **models}, pools=POOLS, tenants=[]), clock=clock)


def test_adapters_and_aliases_listed_by_the_replicas_are_admitted_as_their_model(clock):
    core = listed_core(clock)
    assert core.wants_listings("pool_a") and not core.wants_listings("pool_b")
    assert core.decide(RequestFacts(header_class="batch", model="late-lora")).reason == "unknown_model"
    served = core.set_listings("pool_a", [
        [card("llama"), card("llama-3.1-70b"), card("sql-lora", "llama")],
        [card("llama"), card("llama-3.1-70b"), card("late-lora", "llama-3.1-70b"), card("other", "not-ours")]])
    assert served == {"llama-3.1-70b": "llama", "sql-lora": "llama", "late-lora": "llama"}
    for name in served:
        d = core.decide(RequestFacts(header_class="batch", model=name))
        assert (d.kind, d.cluster, d.charge.model) == (ACCEPT, "pool_a", "llama"), name
        core.finish(d.ticket, Outcome.OK)
    assert core.decide(RequestFacts(header_class="batch", model="other")).reason == "unknown_model"
    core.set_listings("pool_a", [[card("llama")]])  # unloaded everywhere: refused again
    assert core.decide(RequestFacts(header_class="batch", model="late-lora")).reason == "unknown_model"


def test_a_replica_names_nothing_for_a_model_it_does_not_serve(clock):
    core = listed_core(clock)
    # A replica of the pool serving another base (or a listing of any shape) admits none of its names.
    assert core.set_listings("pool_a", [[card("mistral"), card("m-lora", "mistral")], "junk", [None, 3]]) == {}
    assert core.decide(RequestFacts(header_class="batch", model="m-lora")).reason == "unknown_model"


def test_a_card_whose_parent_is_not_a_name_is_not_an_adapter_and_breaks_nothing(clock):
    # A replica's /v1/models with "parent": [] (or {}) raised TypeError (unhashable) in set_listings, after the
    # listing was stored: every later reload raised it too, half way through installing the policy.
    core = listed_core(clock)
    served = core.set_listings("pool_a", [[card("llama"), card("odd", ["llama"]), card("odd2", {"a": 1}),
                                           card("sql-lora", "llama")]])
    assert served == {"sql-lora": "llama"}
    core.apply(make_policy(models={**LISTED, "small": {"cluster": "pool_b", "aliases": ["tiny"]}}, pools=POOLS,
                           tenants=[]))
    d = core.decide(RequestFacts(header_class="batch", model="tiny"))
    assert (d.kind, d.charge.model) == (ACCEPT, "small")


def test_a_listed_name_never_takes_a_name_from_the_policy(clock):
    core = listed_core(clock)
    core.set_listings("pool_a", [[card("llama"), card("small")]])  # a replica of pool_a says it serves `small`
    d = core.decide(RequestFacts(header_class="batch", model="small"))
    assert (d.cluster, d.charge.model) == ("pool_b", "small")


def test_reload_without_names_from_replicas_forgets_them(clock):
    core = listed_core(clock)
    core.set_listings("pool_a", [[card("llama"), card("sql-lora", "llama")]])
    assert core.decide(RequestFacts(header_class="batch", model="sql-lora")).kind == ACCEPT
    core.apply(make_policy(models={"llama": {"cluster": "pool_a"}, "small": {"cluster": "pool_b"}}, pools=POOLS,
                           tenants=[]))
    assert core.decide(RequestFacts(header_class="batch", model="sql-lora")).reason == "unknown_model"


def test_names_from_replicas_turned_back_on_wait_for_the_replicas_to_be_read_again(clock):
    """A pool's last listings were kept after a reload that stopped reading them (the model no longer takes names
    from its replicas, or the pool was removed): turned back on, the names they listed then were admitted at once,
    before the scraper read what the replicas serve now (an adapter unloaded meanwhile got the replicas' 404)."""
    core = listed_core(clock)
    core.set_listings("pool_a", [[card("llama"), card("sql-lora", "llama")]])
    core.apply(make_policy(models={"small": {"cluster": "pool_b"}}, tenants=[]))
    core.apply(make_policy(models=LISTED, pools=POOLS, tenants=[]))
    assert core.decide(RequestFacts(header_class="batch", model="sql-lora")).reason == "unknown_model"
    assert core.state.listings == {}
    core.set_listings("pool_a", [[card("llama"), card("sql-lora", "llama")]])
    assert core.decide(RequestFacts(header_class="batch", model="sql-lora")).kind == ACCEPT


def test_names_from_replicas_needs_a_scraped_pool():
    with pytest.raises(PolicyError) as e:
        make_policy(models=LISTED, tenants=[])
    assert any(err.startswith("models.llama.names_from_replicas: needs pools.pool_a") for err in e.value.errors)


# --- GET /v1/models: every name the edge admits, each once ---

def test_the_catalog_lists_every_admitted_name_once_with_the_replicas_fields_where_read(clock):
    core = listed_core(clock, small={"cluster": "pool_b", "aliases": ["small-alias"],
                                     "cost": {"max_context_tokens": 8192}})
    # Before any replica answered: the policy's names, with what the policy knows.
    assert core.model_catalog() == {
        "llama": {"owned_by": "vllm", "root": "llama", "parent": None, "max_model_len": None},
        "small": {"owned_by": "vllm", "root": "small", "parent": None, "max_model_len": 8192},
        "small-alias": {"owned_by": "vllm", "root": "small", "parent": None, "max_model_len": 8192}}
    base = {**card("llama"), "max_model_len": 4096}
    core.set_listings("pool_a", [[base, {**card("sql-lora", "llama"), "max_model_len": None}],
                                 [base, card("small"), card("other", "not-ours")]])
    cat = core.model_catalog()
    assert list(cat) == ["llama", "sql-lora", "small", "small-alias"]  # `small` keeps its own pool, listed once
    assert cat["llama"] == {"owned_by": "vllm", "root": "/models/llama", "parent": None, "max_model_len": 4096}
    assert cat["sql-lora"] == {"owned_by": "vllm", "root": "/models/sql-lora", "parent": "llama",
                               "max_model_len": None}
    assert core.model_catalog() is cat  # built once per change, not per call
    core.set_listings("pool_a", [[base]])  # the adapter unloaded everywhere: no longer listed
    assert "sql-lora" not in core.model_catalog()
