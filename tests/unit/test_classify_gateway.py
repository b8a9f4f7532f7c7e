"""Gateway API Inference Extension interop: the objective header as a class claim, the fairness-id header as the
fairness key - read only where the policy names them."""

import pytest

from extproc.policy.classify import MAX_FAIRNESS_KEY, Classifier
from extproc.policy.schema import PolicyError
from tests.conftest import make_policy

GIE = {"objective_header": "x-gateway-inference-objective", "fairness_header": "x-gateway-inference-fairness-id",
       "objectives": {"premium": "interactive", "best-effort": "batch"}}


def classifier(**classify):
    return Classifier(make_policy(classify=classify) if classify else make_policy())


def test_the_objective_names_the_class_through_the_objectives_map():
    c = classifier(**GIE).classify(None, None, None, objective="best-effort")
    assert (c.cls, c.unknown) == ("batch", False)


def test_an_objective_not_in_the_map_is_taken_as_a_class_name():
    assert classifier(**GIE).classify(None, None, None, objective="internal").cls == "internal"
    c = classifier(**GIE).classify(None, None, None, objective="gold")
    assert (c.cls, c.unknown) == ("interactive", True)


def test_the_class_header_wins_over_the_objective_and_the_objective_over_the_body():
    c = classifier(**GIE)
    assert c.classify(None, "internal", "batch", objective="premium").cls == "internal"
    assert c.classify(None, None, "internal", objective="best-effort").cls == "batch"


def test_the_objective_is_a_claim_the_tenant_cap_still_applies_to():
    c = classifier(**GIE).classify("sk-acme", None, None, objective="premium")  # acme may use batch at most
    assert (c.cls, c.demoted) == ("batch", True)


def test_the_fairness_header_names_the_flow_when_the_policy_reads_it():
    c = classifier(**GIE).classify("sk-acme", None, None, fairness_id="team-7")
    assert (c.tenant, c.fairness_key, c.flow) == ("acme", "team-7", "acme\x00team-7")  # inside its tenant


def test_without_the_policy_option_the_flow_is_the_tenant():
    c = classifier().classify("sk-acme", None, None, objective="batch", fairness_id="team-7")
    assert (c.fairness_key, c.flow) == ("", "acme")
    c = classifier(**GIE).classify("sk-acme", None, None, fairness_id="")
    assert c.flow == "acme"


def test_a_fairness_key_from_a_header_is_cut_to_its_bound():
    c = classifier(**GIE).classify(None, None, None, fairness_id="x" * 1000)
    assert len(c.fairness_key) == MAX_FAIRNESS_KEY


def test_an_objective_mapped_to_an_unknown_class_is_refused_with_its_key_path():
    with pytest.raises(PolicyError) as e:
        make_policy(classify={"objectives": {"premium": "gold"}})
    assert any(line.startswith("classify.objectives.premium: unknown class 'gold'") for line in e.value.errors)
