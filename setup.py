"""Build of smdistributed: the native core (C++17, pybind11) plus the Python packages.

The source folders follow the product's design card (native/, common/, frontends/...);
package_dir maps them onto the import paths users write.
"""
import os
import platform

import shutil

from pybind11.setup_helpers import Pybind11Extension, ParallelCompile, build_ext
from setuptools import setup
from setuptools.command.build_py import build_py

ParallelCompile("SMDDP_BUILD_JOBS", default=0).install()

native_sources = sorted(
    os.path.join("native", f) for f in os.listdir("native") if f.endswith(".cc")
)

compile_args = ["-O3", "-fvisibility=hidden"]
# Reductions are vectorised by the compiler: tune for the build machine unless a portable
# wheel is wanted (SMDDP_PORTABLE_BUILD=1).
if os.environ.get("SMDDP_PORTABLE_BUILD") != "1" and platform.machine() in ("x86_64", "AMD64"):
    compile_args.append("-march=native")

# Sanitizer builds for testing the core (SMDDP_SANITIZE=address or thread): run Python with the
# sanitizer's runtime preloaded, e.g. LD_PRELOAD=$(g++ -print-file-name=libasan.so).
link_args = []
sanitize = os.environ.get("SMDDP_SANITIZE", "")
if sanitize:
    compile_args = [a for a in compile_args if a != "-O3"] + ["-O1", "-g", "-fno-omit-frame-pointer",
                                                              f"-fsanitize={sanitize}"]
    link_args.append(f"-fsanitize={sanitize}")

ext = Pybind11Extension(
    "smdistributed._core",
    native_sources,
    cxx_std=17,
    extra_compile_args=compile_args,
    # Some toolchains (the CUDA image's /opt/gcc wrapper) link libstdc++ statically. Its
    # symbols must stay private to this module: exported, some of them resolve to another
    # libstdc++ already in the process and iostreams crash. Export only PyInit__core.
    extra_link_args=["-Wl,--version-script=" + os.path.join("native", "exports.map")] + link_args,
    libraries=["rt", "dl"],
    depends=[os.path.join("native", f) for f in os.listdir("native") if f.endswith((".h", ".map"))],
)


class build_py_with_c_api(build_py):
    """The torch Backend's sources ship as package data, compiled on first import against the
    installed torch; they include the core's C interface header, which lives in native/."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "smdistributed", "dataparallel", "torch", "csrc")
        os.makedirs(target, exist_ok=True)
        shutil.copy(os.path.join("native", "c_api.h"), target)


setup(
    ext_modules=[ext],
    cmdclass={"build_ext": build_ext, "build_py": build_py_with_c_api},
    package_data={"smdistributed.dataparallel.torch": ["csrc/*.cc", "csrc/*.h"]},
    package_dir={
        "smdistributed": "frontends/package_roots/smdistributed",
        "smdistributed.common": "common",
        "smdistributed.dataparallel": "frontends/package_roots/dataparallel",
        "smdistributed.dataparallel.torch": "frontends/torch",
        "smdistributed.dataparallel.torch.parallel": "frontends/torch/parallel",
        "smdistributed.dataparallel.tensorflow": "frontends/tensorflow",
        "smdistributed.dataparallel.tensorflow.keras": "frontends/tensorflow/keras",
        "smdistributed.modelparallel": "frontends/package_roots/modelparallel",
        "smdistributed.modelparallel.torch": "frontends/modelparallel/torch",
    },
    packages=[
        "smdistributed",
        "smdistributed.common",
        "smdistributed.dataparallel",
        "smdistributed.dataparallel.torch",
        "smdistributed.dataparallel.torch.parallel",
        "smdistributed.dataparallel.tensorflow",
        "smdistributed.dataparallel.tensorflow.keras",
        "smdistributed.modelparallel",
        "smdistributed.modelparallel.torch",
    ],
)
