import pytest
from flax import nnx

from jaxrl.models import Transformer, split_params
from serving.core.orchestrator import Orchestrator
from serving.runner.engine import Engine
from tests.serving.common import CFG, ENGINE


@pytest.fixture(scope="session")
def model():
    return Transformer(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="session")
def params(model):
    return split_params(model)[1]


@pytest.fixture(scope="session")
def engine(params):
    return Engine(CFG, ENGINE)     # no weights and no state: shared safely


@pytest.fixture(scope="module")   # its loop ends with the module (tests/conftest.py checks)
def orchestrator(engine, params):
    with Orchestrator(engine, params) as o:
        yield o
