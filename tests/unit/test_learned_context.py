"""A model's context length learned from its pool's replicas' /v1/models (their `max_model_len`) where the policy
sets no `cost.max_context_tokens`: it bounds the estimate and the degrade clamp as a configured one does."""

import pytest

from extproc.policy import served
from extproc.policy.admission import ACCEPT, DEGRADE, REJECT, AdmissionController, RequestFacts
from tests.conftest import make_policy

POOLS = {"pool_a": {"replicas": ["10.0.0.1:8000"]}, "pool_b": {"replicas": ["10.0.0.2:8000"]}}
HUGE = 2**31 - 1


def card(name, length=None, parent=None):
    c = {"id": name, "object": "model", "root": f"/models/{name}", "parent": parent}
    return c if length is None else {**c, "max_model_len": length}


def learning_core(clock, pools=POOLS, classes=None, tenants=(), **models):
    models = models or {"llama": {"cluster": "pool_a", "aliases": ["chat"]}, "small": {"cluster": "pool_b"}}
    extra = {"classes": classes} if classes else {}
    return AdmissionController(make_policy(models=models, pools=pools, tenants=list(tenants), **extra), clock=clock)


def context(core, model="llama"):
    return core.cost_models[model].context_tokens


# --- which pools are read, and what they admit ---

def test_a_scraped_pool_is_read_for_a_model_without_a_context_and_admits_no_more_names(clock):
    core = learning_core(clock, pools={"pool_a": POOLS["pool_a"]},
                         llama={"cluster": "pool_a"}, small={"cluster": "pool_b"},
                         big={"cluster": "pool_c", "cost": {"max_context_tokens": 8192}})
    assert core.wants_listings("pool_a")
    assert not core.wants_listings("pool_b")  # not scraped: no replicas to read
    assert not core.wants_listings("pool_c")  # its only model's context is the policy's
    assert core.set_listings("pool_a", [[card("llama", 4096), card("sql-lora", parent="llama")]]) == {}
    assert core.decide(RequestFacts(header_class="batch", model="sql-lora")).reason == "unknown_model"
    assert context(core) == 4096


# --- what a listing teaches ---

def test_the_largest_length_among_the_replicas_serving_the_model_is_learned(clock):
    core = learning_core(clock)
    core.set_listings("pool_a", [[card("llama", 4096)], [card("chat", 8192)], [card("mistral", 16384)]])
    assert context(core) == 8192  # the mistral replica serves another model: its length is not llama's


def test_one_replica_with_a_small_context_does_not_shrink_the_pools_estimates(clock):
    # A replica started with --max-model-len 16 by mistake: with the smallest length learned, every request of the
    # model was estimated at one output token, and a pool limit in tokens took each as its prompt and one token.
    core = learning_core(clock)
    core.set_listings("pool_a", [[card("llama", 8192)], [card("llama", 16)]])
    assert context(core) == 8192
    assert context(core, "small") is None  # pool_b listed nothing yet


@pytest.mark.parametrize("length", [None, True, "4096", 4096.0, 0, -1, 2**40, [4096]],
                         ids=["missing", "bool", "string", "float", "zero", "negative", "huge", "list"])
def test_a_length_that_is_not_a_models_is_not_learned(length):
    listing = [{"id": "llama", "parent": None} if length is None else card("llama", length)]
    assert served.context_lengths([listing], {"llama": "llama"}) == {}


def test_a_listing_of_any_shape_teaches_nothing_and_breaks_nothing():
    assert served.context_lengths(["junk", None, [None, 3, {"id": 7, "max_model_len": 10}]], {"llama": "llama"}) == {}


def test_an_adapter_model_learns_its_parents_length(clock):
    # vLLM lists an adapter with no max_model_len: the base it runs on sets its context.
    core = learning_core(clock, **{"sql-lora": {"cluster": "pool_a"}, "small": {"cluster": "pool_b"}})
    core.set_listings("pool_a", [[card("llama-base", 2048), card("sql-lora", parent="llama-base")]])
    assert context(core, "sql-lora") == 2048


def test_a_name_taken_from_the_replicas_counts_for_its_model(clock):
    core = learning_core(clock, llama={"cluster": "pool_a", "names_from_replicas": True},
                         small={"cluster": "pool_b"})
    # The second replica lists the model only under the name the first one adds for it.
    core.set_listings("pool_a", [[card("llama", 2048), card("llama-70b", 2048)], [card("llama-70b", 8192)]])
    assert context(core) == 8192


def test_a_configured_context_wins(clock):
    core = learning_core(clock, llama={"cluster": "pool_a", "names_from_replicas": True,
                                       "cost": {"max_context_tokens": 8192}}, small={"cluster": "pool_b"})
    core.set_listings("pool_a", [[card("llama", 4096)]])
    assert context(core) == 8192 and core.cost_models["llama"].learned_context is None


def test_a_read_that_lists_no_length_keeps_the_one_learned_until_a_fresh_one_changes_it(clock):
    core = learning_core(clock)
    core.set_listings("pool_a", [[card("llama", 4096)]])
    core.set_listings("pool_a", [])  # every replica refused the connection (restarting)
    core.set_listings("pool_a", [[card("llama")]])  # one lists no length
    assert context(core) == 4096
    core.set_listings("pool_a", [[card("llama", 16384)]])  # restarted with a longer context
    assert context(core) == 16384


# --- reloads ---

def test_a_reload_keeps_the_learned_context_also_for_a_rebuilt_cost_model(clock):
    core = learning_core(clock)
    core.set_listings("pool_a", [[card("llama", 4096)]])
    models = {"llama": {"cluster": "pool_a", "aliases": ["chat"], "cost": {"decode_s_per_token": 0.002}},
              "small": {"cluster": "pool_b"}}
    core.apply(make_policy(models=models, pools=POOLS, tenants=[]))
    assert context(core) == 4096


def test_a_reload_that_sets_the_context_or_stops_reading_the_pool_drops_the_learned_one(clock):
    core = learning_core(clock)
    core.set_listings("pool_a", [[card("llama", 4096)]])
    core.apply(make_policy(models={"llama": {"cluster": "pool_a", "cost": {"max_context_tokens": 8192}},
                                   "small": {"cluster": "pool_b"}}, pools=POOLS, tenants=[]))
    assert context(core) == 8192
    core.apply(make_policy(models={"llama": {"cluster": "pool_a"}, "small": {"cluster": "pool_b"}}, tenants=[]))
    assert context(core) is None  # pool_a no longer scraped: nothing will refresh what it said


def test_a_model_a_reload_puts_on_a_read_pool_learns_from_its_last_listing(clock):
    core = learning_core(clock)
    core.set_listings("pool_a", [[card("llama", 4096), card("tiny", 1024)]])
    core.apply(make_policy(models={"llama": {"cluster": "pool_a"}, "small": {"cluster": "pool_b"},
                                   "tiny": {"cluster": "pool_a"}}, pools=POOLS, tenants=[]))
    assert context(core, "tiny") == 1024


# --- what it bounds ---

def test_the_estimate_of_max_tokens_2_31_is_bounded_by_the_learned_context(clock):
    core = learning_core(clock)
    unbounded = core.decide(RequestFacts(header_class="batch", model="llama", max_tokens=HUGE))
    core.finish(unbounded.ticket)
    core.set_listings("pool_a", [[card("llama", 4096)]])
    d = core.decide(RequestFacts(header_class="batch", model="llama", max_tokens=HUGE))
    # Admitted (the replica, not the edge, refuses past its own length), but charged for what it can produce.
    assert d.kind == ACCEPT and d.charge.estimate.max_tokens <= 4096
    assert d.charge.estimate.gpu_seconds < unbounded.charge.estimate.gpu_seconds / 1000


def test_truncate_to_the_context_uses_the_learned_one(clock):
    core = learning_core(clock)
    core.set_listings("pool_a", [[card("llama", 4096)]])
    assert core.cost_models["llama"].truncated(10_000, -1) == 4096


def test_a_degrade_clamps_to_the_fallback_models_learned_context(clock):
    core = learning_core(
        clock, classes={"interactive": {"max_concurrency": 1, "max_queue": 0, "on_overflow": "fallback",
                                        "fallback": {"action": "degrade", "model": "small"}}},
        tenants=[{"name": "t", "api_keys": ["k"], "tokens_per_minute": 60_000, "max_class": "interactive"}],
        llama={"cluster": "pool_a", "cost": {"max_context_tokens": 32768}}, small={"cluster": "pool_b"})
    core.set_listings("pool_b", [[card("small", 8192)]])
    ask = RequestFacts(api_key="k", model="llama", max_tokens=16_000, stream=True)
    assert core.decide(ask).kind == ACCEPT
    d = core.decide(ask)
    assert d.kind == DEGRADE and d.context_tokens == 8192 and d.charge.estimate.max_tokens == 8192
    core.finish(d.ticket)
    long = RequestFacts(api_key="k", model="llama", max_tokens=10, doc={"prompt": "x" * 4 * 9000})
    d = core.decide(long)
    assert d.kind == REJECT and "does not fit the degrade model small's context" in d.message


def test_the_catalog_gives_an_unlisted_name_the_learned_context(clock):
    core = learning_core(clock)
    core.set_listings("pool_a", [[card("llama", 4096)]])
    cat = core.model_catalog()
    assert cat["llama"]["max_model_len"] == 4096  # the replica's own card
    assert cat["chat"]["max_model_len"] == 4096   # an alias no replica lists: the model's learned length


def test_an_answer_that_cannot_end_early_is_costed_to_the_rest_of_the_learned_context(clock):
    # cost.default_max_tokens's doc: ignore_eos without max_tokens runs to vLLM's cap, the rest of the context,
    # which is the learned one where the policy sets none.
    core = learning_core(clock)
    core.set_listings("pool_a", [[card("llama", 4096)]])
    d = core.decide(RequestFacts(header_class="batch", model="llama", doc={"prompt": "x" * 400}, min_output=None))
    assert d.charge.estimate.max_tokens == 4096 - d.charge.estimate.prompt_tokens
