"""Builds and loads the C++ c10d Backend (csrc/) against the torch this process runs.

Why at first import and not at install: the wheel is built in an isolated environment that
has no torch (the README's install), and a Backend compiled against one torch does not load
into another. So the sources ship with the package and are compiled once per torch version
and source revision (about a minute on 2 cores), into a cache directory shared by every
process of the job: torch.utils.cpp_extension holds a file lock while one process builds and
the others wait for it. Later imports only load the library.

SMDDP_TORCH_BACKEND picks what init_process_group("smddp") runs: native, python, or auto
(native, else the Python process group with a warning that names what was missing).
"""
from __future__ import annotations

import atexit
import hashlib
import os
import sys
from typing import Optional

import torch

# Versions whose c10d Backend interface the sources are written against (tested: 2.11, 2.13).
MIN_TORCH = (2, 6)
_SOURCES = ("backend.cc", "work.cc", "module.cc")
_HEADERS = ("backend.h", "c_api.h")


class NativeBackendUnavailable(RuntimeError):
    pass


def _csrc_dir() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


def _torch_version() -> tuple:
    parts = torch.__version__.split("+")[0].split(".")
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts[:2])


def _build_key(src: str) -> str:
    digest = hashlib.sha256()
    # The install location too: a build directory's ninja file names its sources' paths, so two
    # environments sharing one would rebuild in turn, over a library the other has loaded.
    digest.update(os.path.realpath(src).encode() + b"\0")
    for name in _SOURCES + _HEADERS:
        with open(os.path.join(src, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    flavour = f"cu{torch.version.cuda}" if torch.version.cuda else "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"torch{torch.__version__.split('+')[0]}-{flavour}-{py}-{digest.hexdigest()[:12]}"


def build_directory() -> str:
    root = os.environ.get("SMDDP_TORCH_EXTENSION_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "smdistributed", "torch-backend")
    return os.path.join(root, _build_key(_csrc_dir()))


_module = None


def load(verbose: bool = False):
    """The compiled extension, built first if this torch has none yet; raises
    NativeBackendUnavailable naming what is missing (compiler, ninja, torch version, sources)."""
    global _module
    if _module is not None:
        return _module
    if _torch_version() < MIN_TORCH:
        raise NativeBackendUnavailable(
            f"torch {torch.__version__} is older than {'.'.join(map(str, MIN_TORCH))}, the first version whose "
            "c10d Backend interface the native backend is written for")
    src = _csrc_dir()
    missing = [n for n in _SOURCES + _HEADERS if not os.path.exists(os.path.join(src, n))]
    if missing:
        raise NativeBackendUnavailable(f"the backend's sources are missing from {src}: {', '.join(missing)}")
    from torch.utils import cpp_extension

    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        raise NativeBackendUnavailable("ninja is not installed (pip install ninja)") from None
    directory = build_directory()
    os.makedirs(directory, exist_ok=True)
    built = os.path.join(directory, _BUILT_MARKER)
    if os.path.exists(built):
        # Built before for exactly these sources, this torch and this install (the directory's
        # key): load it without ninja or torch's build lock. A process killed while holding
        # that lock (tests kill ranks on purpose) would leave every later import waiting on it.
        return _finish(_import_built(directory))
    try:
        module = cpp_extension.load(
            name=_NAME,
            sources=[os.path.join(src, n) for n in _SOURCES],
            extra_include_paths=[src],
            extra_cflags=["-O2"],
            build_directory=directory,
            with_cuda=False,  # CUDA is reached through torch's device-generic interfaces
            verbose=verbose,
        )
    except Exception as e:
        text = str(e).strip().splitlines()
        raise NativeBackendUnavailable(
            f"building the native backend in {directory} failed: {' / '.join(text[-6:])}") from e
    with open(built + ".tmp", "w") as f:
        f.write(module.__file__ + "\n")
    os.replace(built + ".tmp", built)  # atomic: a reader sees no marker or a whole one
    return _finish(module)


_NAME = "smddp_c10d_backend"
_BUILT_MARKER = "built.ok"


def _import_built(directory: str):
    import importlib.machinery
    import importlib.util

    path = os.path.join(directory, _NAME + ".so")
    loader = importlib.machinery.ExtensionFileLoader(_NAME, path)
    spec = importlib.util.spec_from_file_location(_NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _finish(module):
    global _module
    from smdistributed import _core

    module.load_core(_core._c_api)
    atexit.register(module.stop_all_at_exit)
    _module = module
    return module


def mode() -> str:
    value = os.environ.get("SMDDP_TORCH_BACKEND", "auto").strip().lower() or "auto"
    if value not in ("auto", "native", "python"):
        raise ValueError(f"SMDDP_TORCH_BACKEND={value!r}: expected auto, native or python")
    return value


def try_load() -> tuple:
    """(module or None, why it is None) under SMDDP_TORCH_BACKEND."""
    choice = mode()
    if choice == "python":
        return None, "SMDDP_TORCH_BACKEND=python"
    try:
        return load(), ""
    except NativeBackendUnavailable as e:
        if choice == "native":
            raise
        return None, str(e)


def loaded() -> Optional[object]:
    return _module
