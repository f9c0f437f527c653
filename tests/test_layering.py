"""Issue #59: followed from the public call down, no layer calls back up
into the one above it.

(a) Imports: the package's modules, in the layers below (lowest first),
never import a module of a higher layer (a module may import one of its
own layer). The order is the real graph's: the engine binding imports
`prefetch.errors`, so the errors sit below it, with the other leaves.
Every module must be given a layer here: a new one fails until it is.

(b) Objects: no part of a live OffloadController (prefetch/offload/) holds
a reference to the controller. The parts share an ExchangeState and are
handed the siblings they call; a part reaching its owner is calling back
up.

Each check is also run on a broken case, so that it is known to fail."""
from __future__ import annotations

import ast
import copy
import gc
import pathlib
import re
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "prefetch"

# Lowest first. A module may import its own layer or a lower one.
LAYERS = [
    # leaves: no prefetch imports, used from everywhere (the engine binding too)
    {"prefetch.errors", "prefetch.untrusted_files", "prefetch.progress", "prefetch.read_back"},
    # the engine binding (Cython; its .pxi files are part of _engine, _errors.pxd is C declarations)
    {"prefetch._engine", "prefetch._disk", "prefetch._errors"},
    # over the engine: the (layer, expert) mapping, ids, traces, predictors, checkpoint files
    {"prefetch.expert_prefetcher", "prefetch.expert_ids", "prefetch.trace", "prefetch.predictors",
     "prefetch.history_predictor", "prefetch.checkpoint"},
    # the controller's parts (and the old import paths of two of them)
    {"prefetch.offload", "prefetch.offload.accounting", "prefetch.offload.deferred",
     "prefetch.offload.engine_calls", "prefetch.offload.exchange_state", "prefetch.offload.path_choice",
     "prefetch.offload.preload", "prefetch.offload.routing", "prefetch.offload.routing_context",
     "prefetch.offload.speculation", "prefetch.offload.step_plan", "prefetch.offload.sync_free",
     "prefetch.step_plan", "prefetch.sync_free"},
    # the controller
    {"prefetch.offload.controller", "prefetch.controller"},
    # the transformers adapter's pieces, host and checkpoint experts, expert parallel
    {"prefetch.hf_blocks", "prefetch.hf_guards", "prefetch.hf_load", "prefetch.hf_experts",
     "prefetch.host_experts", "prefetch.checkpoint_experts", "prefetch.expert_parallel"},
    {"prefetch.hf"},
    {"prefetch.integration"},
    {"prefetch"},
]

_PYX_IMPORT = re.compile(r"^\s*(?:from\s+(prefetch[\w.]*)\s+c?import\s+([\w, ]+)|c?import\s+(prefetch[\w.]*))", re.M)


def _module_name(path: pathlib.Path) -> str:
    parts = path.with_suffix("").relative_to(ROOT.parent).parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, known: set) -> set:
    """The prefetch modules `path` imports, anywhere in it (function-level
    imports too). `from prefetch import errors` names the module errors."""
    found = set()
    if path.suffix == ".py":
        pairs = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                pairs += [(a.name, ()) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert not node.level, f"{path}: relative import"
                pairs.append((node.module or "", tuple(a.name for a in node.names)))
    else:  # .pyx / .pxi / .pxd
        pairs = [(m1 or m2, tuple(n.split()[0] for n in (names or "").split(",") if n.strip()))
                 for m1, names, m2 in _PYX_IMPORT.findall(path.read_text())]
    for module, names in pairs:
        if not module.startswith("prefetch"):
            continue
        subs = {f"{module}.{n}" for n in names} & known
        found |= subs or {module}
    return found


def _graph() -> dict:
    files = [p for p in ROOT.rglob("*") if p.suffix in (".py", ".pyx", ".pxi", ".pxd")]
    modules = {}
    for p in files:
        name = _module_name(p)
        if p.suffix == ".pxi":  # included into the engine binding
            name = "prefetch._engine"
        modules.setdefault(name, []).append(p)
    known = set(modules)
    return {name: set().union(*(_imports(p, known) for p in paths)) - {name} for name, paths in modules.items()}


def _back_edges(graph: dict, layers: list) -> list:
    level = {m: i for i, layer in enumerate(layers) for m in layer}
    unplaced = sorted(set(graph) - set(level))
    assert not unplaced, f"modules with no layer in LAYERS (place them): {unplaced}"
    return sorted((m, d, level[m], level[d]) for m, deps in graph.items() for d in deps
                  if d in level and level[d] > level[m])


def test_layers_name_every_module_once():
    named = [m for layer in LAYERS for m in layer]
    assert len(named) == len(set(named))
    assert set(named) == set(_graph()), set(named) ^ set(_graph())


def test_no_module_imports_a_higher_layer():
    assert _back_edges(_graph(), LAYERS) == []


def test_the_import_check_fails_on_a_back_edge():
    graph = copy.deepcopy(_graph())
    graph["prefetch.offload.sync_free"].add("prefetch.offload.controller")  # a part importing its owner
    assert _back_edges(graph, LAYERS) == [("prefetch.offload.sync_free", "prefetch.offload.controller", 3, 4)]
    graph["prefetch.nobody_placed"] = set()
    with pytest.raises(AssertionError, match="nobody_placed"):
        _back_edges(graph, LAYERS)


# -- (b) no part holds its controller

def _parts(ctl) -> dict:
    """The controller's own objects from this package: its parts, the
    shared state, the routing context, the prefetcher."""
    return {name: v for name, v in vars(ctl).items()
            if type(v).__module__.startswith("prefetch.") and not isinstance(v, types.MethodType)}


def _holders(ctl, parts: dict) -> list:
    """(part, how) for each part that refers to `ctl`: an attribute or slot
    (one level; a bound method's `__self__` counts), or any referent."""
    found = []
    for name, part in parts.items():
        values = dict(getattr(part, "__dict__", {}))
        for cls in type(part).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if hasattr(part, slot):
                    values[slot] = getattr(part, slot)
        for attr, v in values.items():
            if v is ctl or getattr(v, "__self__", None) is ctl:
                found.append((name, attr))
        referents = gc.get_referents(part) + gc.get_referents(getattr(part, "__dict__", {}))
        if any(r is ctl for r in referents):
            found.append((name, "gc referent"))
    return found


@pytest.fixture(scope="module")
def live_controller():
    transformers = pytest.importorskip("transformers")
    import torch

    from prefetch.integration import NextLayerGatePredictor, offload_moe_experts

    cfg = transformers.OlmoeConfig(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128, intermediate_size=40,
                                   num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", preload=False,
                              predictor=NextLayerGatePredictor())
    ids = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0)
    yield ctl
    ctl.close()


def test_no_part_holds_its_controller(live_controller):
    ctl = live_controller
    parts = _parts(ctl)
    for name in ("state", "context", "acct", "gate", "preloader", "routing", "speculation", "sync", "plan",
                 "calls"):
        assert name in parts, name
    assert _holders(ctl, parts) == []


def test_the_holder_check_fails_on_a_part_that_holds_it(live_controller):
    ctl = live_controller
    parts = _parts(ctl)
    calls = parts["calls"]
    calls._owner = ctl
    try:
        assert ("calls", "_owner") in _holders(ctl, parts)
    finally:
        del calls._owner
    sync = parts["sync"]
    sync._flush = ctl.flush  # a bound method of the controller is a reference to it
    try:
        assert ("sync", "_flush") in _holders(ctl, parts)
    finally:
        del sync._flush
    assert _holders(ctl, parts) == []
