"""Builds the smddp c10d Backend once, before any test starts ranks.

The Backend is compiled against the installed torch on first import (about a minute on 2
cores, then cached). Built here, in the pytest process, the ranks of the first multi-process
test load it instead of waiting on the build under their hang-guard timeouts.
"""
import importlib.util
import time


def pytest_configure(config):
    if importlib.util.find_spec("torch") is None:
        return
    from smdistributed.dataparallel.torch import native_backend

    if native_backend.mode() == "python":
        return
    start = time.perf_counter()
    native_backend.load()  # a failure here is the failure users would meet: let it show
    took = time.perf_counter() - start
    if took > 1:
        print(f"\nbuilt the smddp c10d Backend in {took:.0f} s ({native_backend.build_directory()})")


# Test tiers. In-process tests (negotiation units, the configuration table, bucket planners,
# argument checks, discovery, and the in-process half of the model-parallel tests) run first
# and carry the `inprocess` marker: `python -m pytest tests -m inprocess` runs that tier alone
# in seconds. Everything that starts rank processes comes after.
_IN_PROCESS_MODULES = {"test_bucket_plan", "test_collective_args", "test_config_table", "test_coordinator",
                       "test_hit_agreement",
                       "test_discovery"}
# Modules that mix both: a test is in-process when its own code starts nothing.
_MIXED_MODULES = {"test_modelparallel"}
_STARTS_PROCESSES = ("run_world(", "subprocess", "Popen(", "_launch(")


def _in_process(item) -> bool:
    import inspect

    module = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""
    if module in _IN_PROCESS_MODULES:
        return True
    if module not in _MIXED_MODULES:
        return False
    try:
        source = inspect.getsource(item.function)
    except (OSError, TypeError):
        return False
    return not any(s in source for s in _STARTS_PROCESSES)


def pytest_collection_modifyitems(config, items):
    import pytest

    tier = {}
    for item in items:
        fast = _in_process(item)
        if fast:
            item.add_marker(pytest.mark.inprocess)
        tier[item.nodeid] = 0 if fast else 1
    items.sort(key=lambda it: tier[it.nodeid])  # stable: file order kept inside a tier
