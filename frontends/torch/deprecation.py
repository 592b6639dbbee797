"""One warning per deprecated entry point, naming what replaces it."""
import threading
import warnings

_warned = set()
_lock = threading.Lock()


def warn_once(name: str, replacement: str) -> None:
    with _lock:
        if name in _warned:
            return
        _warned.add(name)
    warnings.warn(
        f"smdistributed.dataparallel.torch: {name} is deprecated; use {replacement} instead",
        FutureWarning,
        stacklevel=3,
    )
