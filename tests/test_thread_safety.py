"""tools/thread_safety_check.py: clang's thread-safety analysis of the engine
(Note [Checked lock discipline] in src_cpp/thread_annotations.h). The engine
must be clean, and the checker must fail on a real violation, on a file it
cannot parse and, unless --optional, without libclang."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKER = ROOT / "tools" / "thread_safety_check.py"
N_SOURCES = len((ROOT / "src_cpp" / "SOURCES").read_text().split())


def check(*args):
    return subprocess.run([sys.executable, str(CHECKER), *map(str, args)], capture_output=True,
                          text=True, timeout=300)


needs_libclang = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import clang.cindex as c; c.Index.create()"],
                   capture_output=True).returncode != 0,
    reason="libclang not installed (pip install libclang)")

VIOLATIONS = """\
#include "thread_annotations.h"

class Counter {
 public:
  void Good() EXCLUDES(mu_) {
    prefetch::MutexGuard lk(mu_);
    BumpLocked();
  }
  void Unlocked() { BumpLocked(); }       // *Locked without the lock
  void Racy() { ++n_; }                   // guarded member without it
  void Dropped() EXCLUDES(mu_) {
    prefetch::MutexLock lk(mu_);
    lk.unlock();
    ++n_;                                 // after the lock was dropped
    lk.lock();
  }

 private:
  void BumpLocked() REQUIRES(mu_) { ++n_; }
  prefetch::Mutex mu_;
  int n_ GUARDED_BY(mu_) = 0;
};
"""


@needs_libclang
def test_engine_sources_are_clean():
    r = check()
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{N_SOURCES} files, 0 diagnostics" in r.stdout


@needs_libclang
def test_violations_are_reported(tmp_path):
    bad = tmp_path / "bad.cpp"
    bad.write_text(VIOLATIONS)
    r = check(bad)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "bad.cpp:9:" in r.stdout and "calling function 'BumpLocked' requires holding mutex 'mu_'" in r.stdout
    assert "bad.cpp:10:" in r.stdout and "writing variable 'n_' requires holding mutex 'mu_'" in r.stdout
    assert "bad.cpp:14:" in r.stdout
    assert "1 files, 3 diagnostics" in r.stdout


@needs_libclang
def test_the_same_file_locked_is_clean(tmp_path):
    good = tmp_path / "good.cpp"
    good.write_text(VIOLATIONS.replace("void Unlocked() { BumpLocked(); }", "")
                    .replace("void Racy() { ++n_; }", "")
                    .replace("    ++n_;                                 // after", "    // after"))
    r = check(good)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 files, 0 diagnostics" in r.stdout


@needs_libclang
def test_a_file_that_does_not_parse_fails(tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text('#include "no_such_header.h"\n')
    r = check(broken)
    assert r.returncode == 1
    assert "no_such_header.h" in r.stdout and "fatal" in r.stdout


def test_without_libclang_fails_unless_optional(monkeypatch, capsys):
    sys.path.insert(0, str(CHECKER.parent))
    try:
        import thread_safety_check
    finally:
        sys.path.remove(str(CHECKER.parent))
    monkeypatch.setitem(sys.modules, "clang", None)  # import clang.cindex raises ImportError
    monkeypatch.setitem(sys.modules, "clang.cindex", None)
    assert thread_safety_check.main([]) == 1
    assert thread_safety_check.main(["--optional"]) == 0
    assert "NOT checked" in capsys.readouterr().out
