"""Builds the one extension, prefetch._engine: the Cython binding plus the
C++ engine in src_cpp/. Metadata lives in pyproject.toml.

PREFETCH_DEBUG=1 turns Cython's bounds and wraparound checks back on and
builds the C++ with -O0 -g. PREFETCH_SANITIZE=address|thread adds the
sanitizer flags (see tox.ini).
"""
import os

from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("PREFETCH_DEBUG", "") not in ("", "0")
SANITIZE = os.environ.get("PREFETCH_SANITIZE", "")

COMPILER_DIRECTIVES = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "embedsignature": True,
    # Method docs start with "name(self, ...)"; the class docstring carries
    # its own text signature (PrefetchHandle(...)\n--), which inspect reads.
    "embedsignature.format": "python",
}

ENGINE_SOURCES = [
    "src_cpp/archer_prefetch_handle.cpp",
    "src_cpp/device_cache.cpp",
    "src_cpp/host_backend.cpp",
    "src_cpp/cuda_backend.cpp",
]

compile_args = ["-std=c++17", "-Wall", "-Wno-unused-function"]
link_args = ["-pthread"]
compile_args += ["-O0", "-g"] if DEBUG else ["-O3"]
if SANITIZE == "address":
    flags = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
    compile_args += flags
    link_args += flags
elif SANITIZE == "thread":
    compile_args += ["-fsanitize=thread", "-g"]
    link_args += ["-fsanitize=thread"]
elif SANITIZE:
    raise SystemExit(f"PREFETCH_SANITIZE must be 'address' or 'thread', got {SANITIZE!r}")

extension = Extension(
    "prefetch._engine",
    sources=["prefetch/_engine.pyx", *ENGINE_SOURCES],
    include_dirs=["src_cpp", "prefetch"],
    language="c++",
    extra_compile_args=compile_args,
    extra_link_args=link_args,
    libraries=["dl"],
)

setup(ext_modules=cythonize([extension], compiler_directives=COMPILER_DIRECTIVES))
