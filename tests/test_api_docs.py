"""What help() and inspect show of the public API: the constructor's
signature, every option and stats key documented, no public method without a
docstring."""
import ast
import inspect
import re
from pathlib import Path

import pytest

import prefetch

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = [
    "device_budget_bytes", "backend", "num_devices", "eviction_policy", "cycle_acquires", "copy_chunk_bytes",
    "max_bytes_in_flight", "max_speculative_bytes_in_flight", "copy_lanes", "copy_poll_us", "start_paused",
    "poison_freed_slots",
]


def init_signature_in_source() -> inspect.Signature:
    """The signature of PrefetchHandle.__init__ as written in _engine.pyx
    (plain Python syntax), defaults evaluated."""
    text = (ROOT / "prefetch/_engine.pyx").read_text()
    match = re.search(r"\n    def __init__\((.*?)\n    \):", text, re.S)
    assert match, "PrefetchHandle.__init__ not found in _engine.pyx"
    namespace = {}
    exec(compile(ast.parse(f"def __init__({match.group(1)}\n): pass"), "_engine.pyx", "exec"), namespace)
    params = list(inspect.signature(namespace["__init__"]).parameters.values())[1:]  # drop self
    return inspect.Signature(params)


def test_constructor_signature_is_visible_to_inspect_and_help():
    sig = inspect.signature(prefetch.PrefetchHandle)
    assert list(sig.parameters)[: len(OPTIONS)] == OPTIONS
    for p in sig.parameters.values():
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, p
    assert sig.parameters["device_budget_bytes"].default is inspect.Parameter.empty
    assert sig.parameters["copy_chunk_bytes"].default == 4 << 20
    assert sig.parameters["max_bytes_in_flight"].default == 256 << 20
    assert sig.parameters["copy_lanes"].default == 2
    assert sig.parameters["copy_poll_us"].default == 20
    text = inspect.getdoc(prefetch.PrefetchHandle)
    assert text.startswith("An expert prefetch engine")  # the signature line is not repeated
    import pydoc

    page = pydoc.render_doc(prefetch.PrefetchHandle, renderer=pydoc.plaintext)
    assert "PrefetchHandle(*, device_budget_bytes, backend='auto'" in page


def test_the_documented_signature_is_the_real_one():
    # The class docstring carries the signature inspect reads (an extension
    # type's __init__ has none of its own); it must match __init__.
    assert inspect.signature(prefetch.PrefetchHandle) == init_signature_in_source()


def test_every_option_is_documented_once_in_the_class_docstring():
    doc = inspect.getdoc(prefetch.PrefetchHandle)
    for name in OPTIONS:
        entries = re.findall(rf"^{name}\b", doc, re.M)
        assert len(entries) == 1, f"{name}: {len(entries)} entries in the class docstring"
    for name in ("faults", "debug_issue_delay_us"):
        assert name in doc


def test_every_stats_key_is_documented(make_handle):
    doc = prefetch.PrefetchHandle.stats.__doc__
    keys = make_handle(device_budget_bytes=4096).stats().keys()
    missing = [k for k in keys if not re.search(rf"\b{k}\b", doc)]
    assert not missing, f"stats() keys without a word in its docstring: {missing}"
    for key in ("wasted", "late"):
        line = re.search(rf"^\s*{key}\s+(.+)$", doc, re.M)
        assert line and len(line.group(1)) > 20, f"{key} is not explained"


@pytest.mark.parametrize("name", sorted(n for n in dir(prefetch.PrefetchHandle) if not n.startswith("_")))
def test_every_public_member_has_a_docstring(name):
    member = getattr(prefetch.PrefetchHandle, name)
    if name in ("backend", "eviction_policy", "num_devices"):  # readonly fields, documented on the class
        assert name in prefetch.PrefetchHandle.__doc__
        return
    doc = inspect.getdoc(member) or ""
    # Method docs start with the embedded signature line; a docstring needs more.
    body = doc.split("\n\n", 1)[1] if doc.startswith(f"{name}(") and "\n\n" in doc else doc
    assert body.strip() and not body.startswith(f"{name}("), f"PrefetchHandle.{name} has no docstring"


def test_method_signatures_are_visible():
    sig = inspect.signature(prefetch.PrefetchHandle.acquire)
    assert list(sig.parameters) == ["self", "tensor_ids", "stream", "timeout"]
    assert sig.parameters["timeout"].default == prefetch.DEFAULT_ACQUIRE_TIMEOUT_S
