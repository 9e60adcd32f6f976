import pytest
import torch._logging._internal as torch_logging

from tests.ranks import RankPool

# pytest attaches its log handlers to every logger that does not propagate, and
# torch's structured trace log is one: with a handler on it, torch builds a
# record, with the stack, for every fake tensor and symbol a trace makes (a
# tenth of the suite's time). Its records are DEBUG, below what pytest keeps;
# made to propagate, the log is left without handlers and torch skips them.
torch_logging.trace_log.propagate = True
for handler in list(torch_logging.trace_log.handlers):
    torch_logging.trace_log.removeHandler(handler)

_pools: dict[int, RankPool] = {}


def _pool(world_size: int) -> RankPool:
    pool = _pools.get(world_size)
    if pool is None or not pool.alive:
        pool = _pools[world_size] = RankPool(world_size)
    return pool


@pytest.fixture
def ranks2() -> RankPool:
    return _pool(2)


@pytest.fixture
def ranks3() -> RankPool:
    return _pool(3)


@pytest.fixture
def ranks4() -> RankPool:
    return _pool(4)


@pytest.fixture
def ranks8() -> RankPool:
    return _pool(8)


def pytest_collection_modifyitems(config, items):
    """Tests on real ranks are slow (so are those marked in their files, and
    those that compile, marked `compiles`): `pytest -m "not slow"` runs the rest."""
    for item in items:
        if {"ranks2", "ranks3", "ranks4", "ranks8"} & set(getattr(item, "fixturenames", ())) \
                or item.get_closest_marker("compiles"):
            item.add_marker(pytest.mark.slow)


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()
