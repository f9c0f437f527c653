#!/usr/bin/env python3
"""Checks the engine's lock discipline with clang's thread-safety analysis.

The engine is built with gcc, which has no such analysis. Its annotations
(src_cpp/thread_annotations.h: GUARDED_BY, REQUIRES, EXCLUDES, ...) expand
to clang attributes only under clang, so this tool parses every source in
src_cpp/SOURCES with libclang (the `libclang` PyPI package, no clang
install needed) and -Wthread-safety, the way a clang build would, and fails
on every finding: a guarded member touched without mu_, a *Locked helper
called without it, a lock dropped and not retaken. Any error (a file that
does not parse) fails it too, so a check that could not run cannot pass.
Before the sources it parses a canary with a deliberate violation and fails
unless that is reported: an analysis that silently does nothing fails too.

    python tools/thread_safety_check.py            # the engine (tox -e lint)
    python tools/thread_safety_check.py a.cpp ...  # given files instead
    python tools/thread_safety_check.py --optional # exit 0 without libclang

Exit status: 0 clean, 1 a finding, an error, or no libclang (unless
--optional).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src_cpp"

# -Wthread-safety is -analysis, -attributes, -precise and -reference. Beta
# adds checks still under development upstream (clean on the engine too).
WARNINGS = ["-Wthread-safety", "-Wthread-safety-beta"]
# The defines of the real build (setup.py, sysconfig's CFLAGS), C++17.
DEFINES = ["-DNDEBUG"]

CANARY = """\
#include "thread_annotations.h"
struct Canary {
  prefetch::Mutex mu;
  int n GUARDED_BY(mu) = 0;
  void Bump() { ++n; }  // deliberately without mu
};
"""


def gcc_include_dir() -> str | None:
    """gcc's own headers (stddef.h, stdarg.h): the libclang wheel ships none."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    try:
        path = subprocess.run([cc, "-print-file-name=include/stddef.h"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return os.path.dirname(path) if os.path.isabs(path) else None


def compile_args() -> list[str]:
    args = ["-x", "c++", "-std=c++17", *WARNINGS, *DEFINES, "-I", str(SRC), "-I", str(ROOT / "prefetch")]
    inc = gcc_include_dir()
    if inc is not None:
        args += ["-isystem", inc]
    return args


def engine_sources() -> list[Path]:
    return [ROOT / line for line in (SRC / "SOURCES").read_text().split()]


def reported(diag, cindex) -> bool:
    """A thread-safety finding, or anything of error severity."""
    return diag.option.startswith("-Wthread-safety") or diag.severity >= cindex.Diagnostic.Error


def describe(diag, cindex) -> str:
    loc = diag.location
    where = f"{loc.file.name}:{loc.line}:{loc.column}" if loc.file else "<unknown>"
    kind = {cindex.Diagnostic.Warning: "warning", cindex.Diagnostic.Error: "error",
            cindex.Diagnostic.Fatal: "fatal"}.get(diag.severity, "note")
    option = f" [{diag.option}]" if diag.option else ""
    return f"{where}: {kind}: {diag.spelling}{option}"


def parse(cindex, index, path: str, args: list[str], unsaved=None) -> list[str]:
    """The reported diagnostics of one file, as lines."""
    try:
        tu = index.parse(path, args=args, unsaved_files=unsaved)
    except cindex.TranslationUnitLoadError as ex:
        return [f"{path}: error: libclang could not parse it ({ex})"]
    return [describe(d, cindex) for d in tu.diagnostics if reported(d, cindex)]


def clang_version(cindex) -> str:
    """libclang's version string (cindex does not wrap clang_getClangVersion)."""
    try:
        fn = cindex.conf.lib.clang_getClangVersion
        fn.restype = cindex._CXString
        return cindex._CXString.from_result(fn())
    except Exception:
        return "libclang"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path,
                    help="C++ files to check (default: every file in src_cpp/SOURCES)")
    ap.add_argument("--optional", action="store_true",
                    help="exit 0, saying so, when libclang is not installed")
    opts = ap.parse_args(argv)

    try:
        import clang.cindex as cindex

        index = cindex.Index.create()
    except Exception as ex:  # ImportError, or a wheel whose shared library will not load
        print(f"thread_safety_check: libclang is not usable ({ex}); pip install libclang",
              file=sys.stderr)
        if opts.optional:
            print("thread_safety_check: skipped (--optional): lock discipline NOT checked")
            return 0
        return 1

    version = clang_version(cindex)
    args = compile_args()

    canary_path = str(SRC / "thread_safety_canary.cpp")  # in memory only
    canary = parse(cindex, index, canary_path, args, unsaved=[(canary_path, CANARY)])
    if not any("requires holding mutex 'mu'" in line for line in canary):
        print("thread_safety_check: the analysis did not report the canary's deliberate "
              "violation, so it checks nothing here:", file=sys.stderr)
        for line in canary:
            print("  " + line, file=sys.stderr)
        return 1

    files = opts.files or engine_sources()
    seen: set[str] = set()
    found: list[str] = []
    for path in files:
        for line in parse(cindex, index, str(path), args):
            if line not in seen:  # a header's finding shows up once per includer
                seen.add(line)
                found.append(line)
    for line in found:
        print(line)
    print(f"thread_safety_check: {len(files)} files, {len(found)} diagnostics "
          f"({version}; {' '.join(WARNINGS)})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
