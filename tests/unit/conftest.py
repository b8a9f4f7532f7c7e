import pytest

from extproc.policy.admission import AdmissionController
from tests.conftest import make_policy


@pytest.fixture
def core(clock):
    return AdmissionController(make_policy(), clock=clock)
