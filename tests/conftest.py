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
