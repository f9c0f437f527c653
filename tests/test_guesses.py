"""Note [Guesses filed a step at a time] (prefetch/expert_ids.py): Guesses
behaves as the dict of per-layer entries it replaced, whatever the order of
whole-step filings, single filings, pops and clears."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from prefetch.expert_ids import Guesses

LAYERS, EXPERTS = 4, 6


def file_step_as_dict(model: dict, step: int, flat: np.ndarray, bounds: list) -> None:
    """What the controller did before Guesses: an entry per layer with reads."""
    for layer in range(LAYERS):
        a, b = bounds[layer], bounds[layer + 1]
        if b > a:
            model[(step, layer)] = flat[a:b] - layer * EXPERTS


reads = st.lists(st.integers(0, LAYERS * EXPERTS - 1), unique=True, max_size=10).map(
    lambda r: np.array(sorted(r), dtype=np.int64))
keys = st.tuples(st.integers(0, 3), st.integers(0, LAYERS - 1))
ops = st.one_of(
    st.tuples(st.just("file_step"), st.integers(0, 3), reads),
    st.tuples(st.just("set"), keys, st.lists(st.integers(0, EXPERTS - 1), unique=True, max_size=3)),
    st.tuples(st.just("pop"), keys),
    st.tuples(st.just("pop_count"), keys),
    st.tuples(st.just("take_step"), st.integers(0, 3)),
    st.tuples(st.just("keys")),
    st.tuples(st.just("clear")),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=25))
def test_guesses_behave_as_a_dict_of_layer_entries(program):
    guesses, model = Guesses(), {}
    for op in program:
        kind = op[0]
        if kind == "file_step":
            step, flat = op[1], op[2]
            bounds = np.searchsorted(flat, np.arange(LAYERS + 1) * EXPERTS).tolist()
            guesses.file_step(step, flat, bounds, EXPERTS)
            file_step_as_dict(model, step, flat, bounds)
        elif kind == "set":
            value = np.array(sorted(op[2]), dtype=np.int64)
            guesses[op[1]] = value
            model[op[1]] = value
        elif kind == "pop":
            got, want = guesses.pop(op[1], None), model.pop(op[1], None)
            assert (got is None) == (want is None)
            if want is not None:
                assert got.tolist() == want.tolist()
        elif kind == "pop_count":
            want = model.pop(op[1], None)
            assert guesses.pop_count(op[1]) == (None if want is None else want.shape[0])
        elif kind == "take_step":
            want = [model.pop((op[1], layer), None) is not None for layer in range(LAYERS)]
            assert list(guesses.take_step(op[1], LAYERS)) == want
        elif kind == "keys":
            assert set(guesses.keys()) == set(model)
        else:
            guesses.clear()
            model.clear()
        assert bool(guesses) == bool(model)
    assert set(guesses.keys()) == set(model)
