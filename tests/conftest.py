import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--loop-fuzz", type=int, default=0, metavar="N",
                     help="tests/test_training_loops.py: draw N more training-loop combinations")


@pytest.fixture
def loop_fuzz(request) -> int:
    return request.config.getoption("--loop-fuzz")
