"""The real routing traces of traces/ (issue #60): each file loads with RoutingTrace.load, matches
its row of traces/README.md (layers, experts, steps, top-k), lies within range, carries its source,
and the README's Belady figures are what traces/belady.py computes. A new trace file without a
README row fails here, and so does a README row without its file."""
import importlib.util
import itertools
import json
import pathlib
import random
import re

import pytest

from prefetch.integration import RoutingTrace
from prefetch.trace import belady_misses

TRACES = pathlib.Path(__file__).resolve().parent.parent / "traces"
README = TRACES / "README.md"
FILES = sorted(p.name for p in TRACES.glob("*.json"))


def _load_belady():
    spec = importlib.util.spec_from_file_location("traces_belady", TRACES / "belady.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


belady = _load_belady()  # the script the README's figures come from


def _section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def _rows(section: str) -> list[list[str]]:
    """The cells of the table rows whose first cell is a `file` in traces/ (no slash)."""
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and re.fullmatch(r"`[^`/]+\.json`", cells[0]):
            rows.append([cells[0].strip("`")] + cells[1:])
    return rows


def _table() -> dict:
    """file -> (layers, experts, top_k, decode_steps) from the README's first table."""
    table = {}
    for cells in _rows(_section("The traces in this folder")):
        name, shape, top_k, steps = cells[0], cells[2], cells[3], cells[4]
        layers, experts = (int(x) for x in re.fullmatch(r"(\d+) x (\d+)", shape).groups())
        k = int(re.match(r"(\d+)", top_k).group(1))
        decode = int(re.fullmatch(r"1 prompt step \+ (\d+) decode steps", steps).group(1))
        assert name not in table, f"{name} has two rows"
        table[name] = (layers, experts, k, decode)
    return table


def test_readme_table_lists_every_trace_file_and_no_other():
    table = _table()
    assert FILES, "no trace files in traces/"
    assert sorted(table) == FILES


@pytest.mark.parametrize("name", FILES)
def test_trace_loads_and_matches_its_readme_row(name):
    layers, experts, top_k, decode = _table()[name]
    trace = RoutingTrace.load(str(TRACES / name))
    assert (trace.num_layers, trace.num_experts) == (layers, experts)
    assert len(trace.steps) == 1 + decode
    for s, step in enumerate(trace.steps):
        assert len(step) == layers
        for layer, chosen in enumerate(step):
            assert chosen == sorted(set(chosen)), (s, layer)
            assert all(0 <= e < experts for e in chosen), (s, layer)
            if s == 0:
                # the prompt step is a union over prompt tokens: at least one token's top-k
                assert len(chosen) >= top_k, (s, layer)
            else:
                # a decode step is one token: exactly its top-k experts in every layer
                assert len(chosen) == top_k, (s, layer)


@pytest.mark.parametrize("name", FILES)
def test_trace_names_its_licensed_source(name):
    source = json.loads((TRACES / name).read_text(encoding="utf-8"))["source"]
    assert re.fullmatch(r"[0-9a-f]{40}", source["commit"])
    assert source["license"] == "Apache-2.0"
    assert source["path"] and source["model"]
    owner_repo = source["repo"].split("/")
    assert len(owner_repo) == 2
    # the license text of the source project is kept beside the traces
    assert list((TRACES / "LICENSES").glob(f"*{owner_repo[1]}*Apache-2.0.txt")), source["repo"]
    assert source["path"] in README.read_text(encoding="utf-8")


def test_trace_sizes_stay_within_the_limits():
    sizes = [(TRACES / name).stat().st_size for name in FILES]
    assert max(sizes) < 2 * 1024 * 1024
    assert sum(sizes) < 10 * 1024 * 1024


def test_belady_on_a_hand_worked_example():
    # One layer of experts A, B, C; step 0 warms A, B (not counted). Capacity 2: at step 1 A
    # hits, then C misses and evicts A (never used again) rather than B (used at step 2); step 2
    # hits both. Capacity 1: every counted access misses. Capacity 3: only C's first use.
    a, b, c = 0, 1, 2
    trace = RoutingTrace(1, 3, [[[a, b]], [[a, c]], [[b, c]]])
    assert belady_misses(trace, 2, start_step=1) == 1
    assert belady_misses(trace, 1, start_step=1) == 4
    assert belady_misses(trace, 3, start_step=1) == 1
    # LRU at capacity 2 would evict B for C and miss B at step 2: Belady's is not LRU.
    assert belady_misses(trace, 2, start_step=1, end_step=2) == 1
    assert belady_misses(trace, 2, start_step=2) == 0


def _optimal_hits(seq, capacity, counted_from=1):
    """Exhaustive search over every eviction choice: the most counted hits any policy gets."""
    best = 0

    def go(i, cached, hits):
        nonlocal best
        if i == len(seq):
            best = max(best, hits)
            return
        step, key = seq[i]
        if key in cached:
            go(i + 1, cached, hits + (step >= counted_from))
        elif len(cached) < capacity:
            go(i + 1, cached | {key}, hits)
        else:
            for victim in cached:
                go(i + 1, (cached - {victim}) | {key}, hits)

    go(0, frozenset(), 0)
    return best


def test_belady_is_optimal_against_exhaustive_search():
    rng = random.Random(60)
    for _ in range(40):
        layers, experts = rng.randint(1, 2), rng.randint(2, 3)
        steps = [[sorted(rng.sample(range(experts), rng.randint(0, 2))) for _ in range(layers)]
                 for _ in range(rng.randint(2, 4))]
        trace = RoutingTrace(layers, experts, steps)
        seq = [(s, layer * experts + e) for s, step in enumerate(steps)
               for layer, chosen in enumerate(step) for e in chosen]
        counted = sum(1 for s, _ in seq if s >= 1)
        for capacity in range(1, layers * experts):
            hits = counted - belady_misses(trace, capacity, start_step=1)
            assert hits == _optimal_hits(seq, capacity), (steps, capacity)


def test_readme_belady_figures_are_the_computed_ones():
    rows = _rows(_section("Belady's hit rate"))
    assert sorted(cells[0] for cells in rows) == FILES
    for cells in rows:
        trace = RoutingTrace.load(str(TRACES / cells[0]))
        for share, cell in zip(belady.SHARES, cells[1:4]):
            stated = float(re.fullmatch(r"([\d.]+) %", cell).group(1))
            assert abs(stated - 100 * belady.hit_rate(trace, share)) < 0.051, (cells[0], share)


def test_readme_prompt_ids_match_the_granite_sources():
    # the README describes each Granite request by its prompt token ids; they must be the file's
    for name in FILES:
        source = json.loads((TRACES / name).read_text(encoding="utf-8"))["source"]
        if "prompt_token_ids" not in source:
            continue
        ids = source["prompt_token_ids"]
        assert ids == list(range(ids[0], ids[0] + len(ids)))
        row = next(cells for cells in _rows(_section("The traces in this folder")) if cells[0] == name)
        assert f"{ids[0]}..{ids[-1]}" in row[5]


def test_exhaustive_helper_agrees_with_a_hand_count():
    # guards the exhaustive search itself: after warming A B (capacity 2), C A B C can hit at most
    # twice (C evicts B, A hits, B evicts A, C hits); with capacity 3 only C's first use misses
    a, b, c = 0, 1, 2
    seq = [(0, a), (0, b)] + list(zip(itertools.repeat(1), [c, a, b, c]))
    assert _optimal_hits(seq, 2) == 2
    assert _optimal_hits(seq, 3) == 3
