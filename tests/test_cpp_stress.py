"""Builds tests/cpp/stress.cpp against the engine sources and runs it with 1,
4, 16 and 64 threads, and tests/cpp/next_use_oom.cpp (the next-use policy
when allocations fail). Skips only where no C++ compiler exists."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = (ROOT / "src_cpp" / "SOURCES").read_text().split()  # the C++ sources setup.py builds


def build(tmp_path_factory, name):
    """tests/cpp/NAME.cpp linked with the engine sources, with
    PREFETCH_STRESS_CXXFLAGS (the sanitizer runs set them)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp(name) / name
    flags = os.environ.get("PREFETCH_STRESS_CXXFLAGS", "-O2").split()
    cmd = [cxx, "-std=c++17", *flags, "-pthread", "-I", str(ROOT / "src_cpp"), str(ROOT / f"tests/cpp/{name}.cpp")]
    cmd += [str(ROOT / s) for s in SOURCES] + ["-ldl", "-o", str(out)]
    subprocess.run(cmd, check=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def stress_binary(tmp_path_factory):
    return build(tmp_path_factory, "stress")


def test_next_use_policy_under_allocation_failure(tmp_path_factory):
    # No hook throws when a bucket or an unhinted entry's node cannot be
    # made: the entry goes to the overflow list and comes back on its next
    # touch or hint; kept nodes make a new time, or take a cleared entry
    # back, with no allocation, and a touch of an unhinted entry needs none
    # (Note [Next-use buckets]).
    binary = build(tmp_path_factory, "next_use_oom")
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert proc.stdout.startswith("ok next-use under allocation failure (6 allocations refused)")


@pytest.mark.parametrize("mode", ["host", "async", "link"])
@pytest.mark.parametrize("threads", [1, 4, 16, 64])
def test_cpp_stress(stress_binary, threads, mode):
    run_stress(stress_binary, threads, mode, "lru")


@pytest.mark.parametrize("mode", ["host", "async"])
@pytest.mark.parametrize("threads", [4, 64])
def test_cpp_stress_cyclic_eviction(stress_binary, threads, mode):
    run_stress(stress_binary, threads, mode, "cyclic")


@pytest.mark.parametrize("mode", ["host", "async"])
@pytest.mark.parametrize("threads", [4, 64])
def test_cpp_stress_next_use_eviction(stress_binary, threads, mode):
    run_stress(stress_binary, threads, mode, "next-use")  # with random hints from every thread


def run_stress(stress_binary, threads, mode, eviction):
    ops = max(200, 16000 // threads)
    proc = subprocess.run([str(stress_binary), str(threads), str(ops), mode, eviction], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert proc.stdout.startswith(f"ok threads={threads}")
