import pytest

from extproc.policy.admission import AdmissionController
from extproc.policy.schema import load_policy


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def make_policy(**overrides):
    data = {
        "classes": {
            "interactive": {"max_concurrency": 2, "max_queue": 2, "max_wait_ms": 200},
            "batch": {"max_concurrency": 3, "max_queue": 5, "max_wait_ms": 5000},
            "internal": {"max_concurrency": 1, "max_queue": 1, "max_wait_ms": 5000},
        },
        "default_class": "interactive",
        "tenants": [{"name": "acme", "api_keys": ["sk-acme"], "max_class": "batch", "default_class": "batch"}],
        "models": {"llama": {"cluster": "pool_a"}, "small": {"cluster": "pool_b"}},
    }
    data.update(overrides)
    # Requests without a key stand for a trusted client here (the default caps them at the lowest class).
    data.setdefault("anonymous", {"max_class": next(iter(data["classes"]))})
    return load_policy(data)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def core(clock):
    return AdmissionController(make_policy(), clock=clock)
