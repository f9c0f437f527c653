"""Copies the source tree to DEST and builds the extension there in place
with PREFETCH_SANITIZE (address or thread) from the environment, so a
sanitizer build never replaces the regular one in the checkout.

    python tools/sanitizer_build.py DEST
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

IGNORE = shutil.ignore_patterns(".git", ".tox", "build", "*.so", "*.egg-info", "__pycache__", ".whl", "_engine.cpp",
                                "_disk.cpp")


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    if os.environ.get("PREFETCH_SANITIZE") not in ("address", "thread"):
        print("set PREFETCH_SANITIZE=address or thread", file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parent.parent
    dest = Path(sys.argv[1])
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(root, dest, ignore=IGNORE)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=dest, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
