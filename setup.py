"""Builds two extensions: prefetch._engine, the Cython binding plus the C++
engine in src_cpp/, and prefetch._disk, the disk reader (disk_reader.cpp and
disk_io.cpp there; the engine builds disk_io.cpp too, for its host tier). Metadata lives in
pyproject.toml.

PREFETCH_DEBUG=1 turns Cython's bounds and wraparound checks back on and
builds the C++ with -O0 -g. PREFETCH_SANITIZE=address|thread adds the
sanitizer flags (see tox.ini).
"""
import os
import sys
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

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

# The C++ sources, one per line: also read by tests/test_cpp_stress.py and
# tools/thread_safety_check.py. The disk reader's go into prefetch._disk.
SOURCES = Path(__file__).with_name("src_cpp").joinpath("SOURCES").read_text().split()
DISK_SOURCES = ["src_cpp/disk_reader.cpp", "src_cpp/disk_io.cpp"]
# The engine reads disk-backed tensors itself (Note [Host tier]): it builds disk_io.cpp too.
ENGINE_SOURCES = [s for s in SOURCES if s != "src_cpp/disk_reader.cpp"]

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

def cpp_extension(name: str, sources: list, **extra) -> Extension:
    """A C++ extension of this package: the flags above, headers from src_cpp/ and prefetch/."""
    return Extension(name, sources=sources, include_dirs=["src_cpp", "prefetch"], language="c++",
                     extra_compile_args=compile_args, extra_link_args=link_args, **extra)


extension = cpp_extension("prefetch._engine", ["prefetch/_engine.pyx", *ENGINE_SOURCES], libraries=["dl"])
disk_extension = cpp_extension("prefetch._disk", ["prefetch/_disk.pyx", *DISK_SOURCES])


class BuildExtSaysSo(build_ext):
    """build_ext that says what it is doing: compiling takes about 35 s on 2
    cores, which otherwise looks like a hang (pip shows this line with -v;
    its own output says 'Building ... for prefetch')."""

    def run(self):
        flavour = f", PREFETCH_SANITIZE={SANITIZE}" if SANITIZE else (", debug" if DEBUG else "")
        sources = len(extension.sources) + len(disk_extension.sources)
        print(f"prefetch: building the C++ engine, the disk reader and their Cython bindings ({sources} sources"
              f"{flavour}; compiling takes about 35 s on 2 cores)", file=sys.stderr, flush=True)
        super().run()


setup(ext_modules=cythonize([extension, disk_extension], compiler_directives=COMPILER_DIRECTIVES),
      cmdclass={"build_ext": BuildExtSaysSo})
