"""Size limits of the source: no file over 600 lines, no function over 80
(a command line's `main` excepted; a docstring does not count), in
src_cpp/, prefetch/, bench/ and tools/. Run by `tox -e lint` and `.ci/run`; exits 1 naming each breach.

    python tools/check_sizes.py [--list]

Python functions are measured with `ast`; Cython (.pyx/.pxi/.pxd) by
indentation; C++ from a definition's first line to the brace that closes
its body. PENDING names what was over a limit when the check came in and
is being split: each may not grow past the size listed, and the check
says when one is back under its limit, so that it leaves the list.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILE_LINES = 600
FUNCTION_LINES = 80
DIRS = ("src_cpp", "prefetch", "bench", "tools")
SUFFIXES = {".py", ".pyx", ".pxi", ".pxd", ".cpp", ".h"}

# Over a limit when the check came in, each at most this big now; to be split.
PENDING = {}
PENDING_FUNCTIONS = {}


def _python_functions(path: Path, text: str):
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):  # a docstring is documentation, not size
                length -= first.end_lineno - first.lineno + 1
            yield node.name, node.lineno, length


# A def, cdef or cpdef function; not `cdef class Name(Base):`, a class.
_CY_DEF = re.compile(r"^(\s*)(?:async\s+)?(?:cp?def|def)\s+(?!class\s)(?:[\w\[\]\*, ]+\s+)?(\w+)\s*\(")
_QUOTES = ('"' * 3, "'" * 3)


def _docstring_lines(lines: list, k: int) -> int:
    """The lines of a docstring starting at or after line k (0: none)."""
    while k < len(lines) and not lines[k].strip():
        k += 1
    if k >= len(lines) or not lines[k].strip().startswith(_QUOTES):
        return 0
    quote = lines[k].strip()[:3]
    if lines[k].strip().count(quote) >= 2 and len(lines[k].strip()) > 3:
        return 1
    close = next((x for x in range(k + 1, len(lines)) if quote in lines[x]), k)
    return close - k + 1


def _cython_functions(text: str):
    lines = text.split("\n")
    for i, line in enumerate(lines):
        m = _CY_DEF.match(line)
        if not m or line.rstrip().endswith(("nogil", "except +")) and ":" not in line:
            continue
        indent = len(m.group(1))
        end = i
        for j in range(i + 1, len(lines)):
            stripped = lines[j].strip()
            if not stripped or stripped.startswith("#"):
                continue
            if len(lines[j]) - len(lines[j].lstrip()) <= indent:
                break
            end = j
        if end > i:  # a declaration without a body (.pxd, extern blocks) has none
            yield m.group(2), i + 1, end - i + 1 - _docstring_lines(lines, i + 1)


_CPP_DEF = re.compile(r"^[A-Za-z_][\w:<>,\*&~ ]*?\b(~?\w+)\s*\([^;]*$")


def _cpp_functions(text: str):
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = _CPP_DEF.match(lines[i])
        if not m or lines[i].startswith(("if", "for", "while", "switch", "return", "namespace", "class", "struct")):
            i += 1
            continue
        # the body's opening brace: on this line or a few below, before any ';'
        j = i
        while j < len(lines) and "{" not in lines[j] and ";" not in lines[j] and j - i < 8:
            j += 1
        if j >= len(lines) or "{" not in lines[j]:
            i += 1
            continue
        depth, k = 0, j
        for k in range(j, len(lines)):
            depth += lines[k].count("{") - lines[k].count("}")
            if depth <= 0:
                break
        yield m.group(1), i + 1, k - i + 1
        i = k + 1


def functions(path: Path, text: str):
    if path.suffix == ".py":
        return _python_functions(path, text)
    if path.suffix in (".pyx", ".pxi", ".pxd"):
        return _cython_functions(text)
    return _cpp_functions(text)


def sources() -> list[Path]:
    """The source files of DIRS that git tracks or would (not build outputs
    such as the generated _engine.cpp)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *DIRS], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / p for p in sorted(set(listed)) if Path(p).suffix in SUFFIXES and (ROOT / p).is_file()]


def check() -> list[str]:
    problems = []
    for path in sources():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8")
        count = text.count("\n") + (not text.endswith("\n") and bool(text))
        limit = PENDING.get(rel, FILE_LINES)
        if count > limit:
            problems.append(f"{rel}: {count} lines (limit {limit})")
        elif rel in PENDING and count <= FILE_LINES:
            problems.append(f"{rel}: {count} lines, under {FILE_LINES} now: take it off PENDING")
        for name, line, length in functions(path, text):
            flimit = PENDING_FUNCTIONS.get(f"{rel}:{name}", FUNCTION_LINES)
            if name != "main" and length > flimit:
                problems.append(f"{rel}:{line}: function {name} is {length} lines (limit {flimit})")
    return problems


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    problems = check()
    for p in problems:
        print(f"check_sizes: {p}")
    if "--list" in argv or not problems:
        print(f"check_sizes: {len(problems)} breach(es); {len(PENDING)} file(s) pending a split: "
              + ", ".join(f"{k} ({v})" for k, v in PENDING.items()))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
