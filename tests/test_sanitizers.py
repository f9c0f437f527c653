"""The CPU suite again under AddressSanitizer+UBSan and under
ThreadSanitizer (tools/run_sanitized.py), so CI runs them too. Clean runs are
the bar: any report aborts the inner run and fails here."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.sanitizer


def runtime_missing(mode: str) -> str | None:
    """Why the sanitizer runtime cannot be used here, or None."""
    if shutil.which("gcc") is None:
        return "no gcc"
    for lib in ("libasan.so" if mode == "address" else "libtsan.so", "libstdc++.so"):
        path = subprocess.run(["gcc", f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
        if not path.startswith("/"):
            return f"gcc has no {lib}"
    return None


@pytest.mark.parametrize("mode", ["address", "thread"])
def test_cpu_suite_under_sanitizer(mode, tmp_path):
    missing = runtime_missing(mode)
    if missing:
        pytest.skip(f"sanitizer runtime unavailable: {missing}")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools/run_sanitized.py"), mode, str(tmp_path / "src"),
         "tests", "-m", "not sanitizer and not gpu", "-x"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    tail = (proc.stdout[-3000:] + "\n" + proc.stderr)[-12000:]
    assert proc.returncode == 0, tail
    assert "Sanitizer" not in proc.stderr, tail
    assert " passed" in proc.stdout, tail
