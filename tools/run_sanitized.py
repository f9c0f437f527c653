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
        raise SystemExit(f"{cc} has no {name}: install the sanitizer runtime")
    return path


def main() -> int:
    if len(sys.argv) < 3 or sys.argv[1] not in ("address", "thread"):
        print(__doc__, file=sys.stderr)
        return 2
    mode, dest, pytest_args = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    env = dict(os.environ, PREFETCH_SANITIZE=mode)
    subprocess.run([sys.executable, str(ROOT / "tools/sanitizer_build.py"), str(dest)], env=env, check=True)
    env.update(PYTHONMALLOC="malloc", PYTHONFAULTHANDLER="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(pytest_args or ["tests"])]
    if mode == "address":
        env["LD_PRELOAD"] = f"{gcc_file('libasan.so')} {gcc_file('libstdc++.so')}"
        env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=1:halt_on_error=1"
        env["UBSAN_OPTIONS"] = f"print_stacktrace=1:halt_on_error=1:suppressions={ROOT / 'tools/ubsan.supp'}"
        env["PREFETCH_STRESS_CXXFLAGS"] = "-O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all"
    else:
        env["LD_PRELOAD"] = f"{gcc_file('libtsan.so')} {gcc_file('libstdc++.so')}"
        env["TSAN_OPTIONS"] = f"halt_on_error=1:second_deadlock_stack=1:suppressions={ROOT / 'tools/tsan.supp'}"
        env["PREFETCH_STRESS_CXXFLAGS"] = "-O1 -g -fsanitize=thread"
        if shutil.which("setarch"):
            cmd = ["setarch", "-R", *cmd]
    return subprocess.run(cmd, cwd=dest, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
