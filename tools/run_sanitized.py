"""Builds a sanitizer copy of the package and runs the CPU suite under it.

    python tools/run_sanitized.py address|thread DEST [pytest args...]

address: AddressSanitizer + UBSan (-fno-sanitize-recover=all), leaks off
(CPython and torch keep allocations alive at exit on purpose).
thread: ThreadSanitizer on the host backend (CUDA is not instrumented), run
under `setarch -R` (TSan aborts on high-entropy ASLR layouts).
The runtime is preloaded with libstdc++ (so the __cxa_throw interceptor finds
the real one), PYTHONMALLOC=malloc so Python's allocations are checked too.
Exit status is pytest's; a sanitizer report aborts the run (non-zero).
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def gcc_file(name: str) -> str:
    cc = os.environ.get("CC", "gcc")
    path = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout.strip()
    if not os.path.isabs(path):
        raise SystemExit(
            f"{cc} has no {name}: install the sanitizer runtime (Debian/Ubuntu: g++; Fedora: libasan, libtsan)")
    return path


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] not in ("address", "thread"):
        print(__doc__, file=sys.stderr)
        return 2
    mode, dest, pytest_args = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    name = "AddressSanitizer+UBSan" if mode == "address" else "ThreadSanitizer"
    # Found before the build, so a machine without the runtime fails at once.
    preload = f"{gcc_file('libasan.so' if mode == 'address' else 'libtsan.so')} {gcc_file('libstdc++.so')}"
    env = dict(os.environ, PREFETCH_SANITIZE=mode)
    print(f"run_sanitized: building a copy of the package with {name} in {dest} (C++ and Cython, a minute or two)",
          flush=True)
    subprocess.run([sys.executable, str(ROOT / "tools/sanitizer_build.py"), str(dest)], env=env, check=True)
    env.update(PYTHONMALLOC="malloc", PYTHONFAULTHANDLER="1")
    # Reports also go to files (pytest captures fd 2 of passing tests, and
    # child processes inherit the runtime): DEST/sanitizer.<pid>.
    log_path = dest / "sanitizer"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(pytest_args or ["tests"])]
    if mode == "address":
        env["LD_PRELOAD"] = preload
        env["ASAN_OPTIONS"] = f"detect_leaks=0:abort_on_error=1:halt_on_error=1:log_path={log_path}"
        env["UBSAN_OPTIONS"] = f"print_stacktrace=1:halt_on_error=1:suppressions={ROOT / 'tools/ubsan.supp'}"
        env["PREFETCH_STRESS_CXXFLAGS"] = "-O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all"
    else:
        env["LD_PRELOAD"] = preload
        env["TSAN_OPTIONS"] = (
            f"halt_on_error=1:second_deadlock_stack=1:log_path={log_path}:suppressions={ROOT / 'tools/tsan.supp'}"
        )
        # torch's CPU kernels run on an OpenMP (libgomp) thread team that is
        # not instrumented, so TSan misses its fork/join edges and reports
        # races inside torch (seen: cpu_flash_attention). One OpenMP thread
        # takes that team out of the run without suppressing anything; the
        # engine's own threads are std::threads and stay fully checked.
        env["OMP_NUM_THREADS"] = "1"
        env["PREFETCH_STRESS_CXXFLAGS"] = "-O1 -g -fsanitize=thread"
        if shutil.which("setarch"):
            cmd = ["setarch", "-R", *cmd]
    print(f"run_sanitized: {' '.join(cmd)}  (in {dest}, under {name})", flush=True)
    rc = subprocess.run(cmd, cwd=dest, env=env).returncode
    reports = sorted(dest.glob("sanitizer.*"))
    for report in reports:
        print(f"==== {report.name}", file=sys.stderr)
        print(report.read_text(errors="replace"), file=sys.stderr)
    if reports and rc == 0:
        rc = 1  # a report in a child process that exited 0 still fails the run
    verdict = "clean" if rc == 0 else f"FAILED (exit {rc}, {len(reports)} sanitizer report(s))"
    print(f"run_sanitized: {name}: {verdict}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
