"""The sync-free path's C bookkeeping (prefetch/_routing.pxi) against the
numpy it replaced, and its refusal of out-of-range input."""
import numpy as np
import pytest
from prefetch._engine import (
    distinct_ids,
    distinct_short,
    fill_rows,
    hint_arrays,
    hint_times,
    mark_pinned,
    plan_pins,
    read_routed,
    same_offsets,
    slot_numbers,
    take_ids,
)

LAYERS, EXPERTS = 5, 12


def tables(seed):
    rng = np.random.default_rng(seed)
    pinned = rng.random((LAYERS, EXPERTS)) < 0.6
    owned = rng.random((LAYERS, EXPERTS)) < 0.7
    ids = np.where(owned, np.arange(LAYERS * EXPERTS).reshape(LAYERS, EXPERTS) + 100, -1)
    return rng, pinned, owned, ids


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("all_owned", [True, False])
def test_read_routed_matches_numpy(seed, all_owned):
    rng, pinned, owned, ids = tables(seed)
    if all_owned:
        owned[:] = True
        ids = np.arange(LAYERS * EXPERTS).reshape(LAYERS, EXPERTS) + 100
    layers = sorted(rng.choice(LAYERS, rng.integers(1, LAYERS + 1), replace=False).tolist())
    counts = [int(rng.integers(0, 9)) for _ in layers]  # duplicates across tokens: batch > 1
    host = rng.integers(0, EXPERTS, sum(counts)).astype(np.int64)
    routings = [(layer, 7, None, c) for layer, c in zip(layers, counts)]
    routed_tab = np.ones((LAYERS, EXPERTS), dtype=bool)  # stale bits from a last read must go
    seen = rng.random((LAYERS, EXPERTS)) < 0.5
    seen_before = seen.copy()
    use, fetch, hits, misses, again = read_routed(routings, host, EXPERTS, routed_tab.reshape(-1).view(np.uint8),
                                                  pinned.reshape(-1).view(np.uint8),
                                                  None if all_owned else owned.reshape(-1).view(np.uint8),
                                                  ids.reshape(-1), seen.reshape(-1).view(np.uint8))
    ref = np.zeros((LAYERS, EXPERTS), dtype=bool)
    ref[np.repeat(layers, counts), host] = True
    mine = ref & owned
    assert np.array_equal(routed_tab, ref)
    assert np.array_equal(use, ids[mine]) and np.array_equal(fetch, ids[mine & ~pinned])
    assert (hits, misses) == (int((mine & pinned).sum()), int((mine & ~pinned).sum()))
    # The misses of pairs read before; then every routed pair is seen, owned here or not.
    assert again == int((mine & ~pinned & seen_before).sum())
    assert np.array_equal(seen, seen_before | ref)
    # Without a seen table: the same answers, the last count 0.
    again_routed = np.ones((LAYERS, EXPERTS), dtype=bool)
    got = read_routed(routings, host, EXPERTS, again_routed.reshape(-1).view(np.uint8),
                      pinned.reshape(-1).view(np.uint8), None if all_owned else owned.reshape(-1).view(np.uint8),
                      ids.reshape(-1))
    assert np.array_equal(got[0], use) and np.array_equal(got[1], fetch) and got[2:] == (hits, misses, 0)


@pytest.mark.parametrize("routings,host,match", [
    ([(0, 0, None, 2)], [1, EXPERTS], "expert 12 out of range"),
    ([(0, 0, None, 2)], [-1, 0], "expert -1 out of range"),
    ([(LAYERS, 0, None, 1)], [0], "layer 5 or count 1 out of range"),
    ([(-1, 0, None, 1)], [0], "out of range"),
    ([(0, 0, None, 3)], [0, 1], "out of range"),
    ([(0, 0, None, 1)], [0, 1], "2 routed ids for counts summing to 1"),
])
def test_read_routed_refuses_out_of_range_and_writes_nothing(routings, host, match):
    _, pinned, owned, ids = tables(0)
    routed = np.zeros(LAYERS * EXPERTS, dtype=np.uint8)
    routed[3] = 1
    seen = np.zeros(LAYERS * EXPERTS, dtype=np.uint8)
    with pytest.raises(ValueError, match=match):
        read_routed(routings, np.array(host, dtype=np.int64), EXPERTS, routed, pinned.reshape(-1).view(np.uint8),
                    None, ids.reshape(-1), seen)
    assert routed.sum() == 1 and routed[3] == 1 and not seen.any()


def test_read_routed_refuses_a_seen_table_of_another_size():
    _, pinned, _, ids = tables(0)
    routed = np.zeros(LAYERS * EXPERTS, dtype=np.uint8)
    with pytest.raises(ValueError, match="different sizes"):
        read_routed([(0, 0, None, 1)], np.array([1], dtype=np.int64), EXPERTS, routed,
                    pinned.reshape(-1).view(np.uint8), None, ids.reshape(-1), np.zeros(3, dtype=np.uint8))
    assert not routed.any()


def test_mark_pinned():
    offsets = np.array([-1, 0, 4096, -1, 8192], dtype=np.int64)
    pinned = np.ones(5, dtype=np.uint8)
    answers = np.array([0, -1, 4096], dtype=np.int64)  # what a pin call wrote for the ids asked
    held = mark_pinned(offsets, pinned, answers, np.array([11, 12, 13], dtype=np.int64))
    assert pinned.tolist() == [0, 1, 1, 0, 1]
    assert held.tolist() == [11, 13]
    with pytest.raises(ValueError, match="different sizes"):
        mark_pinned(offsets, pinned[:4], answers, np.array([11, 12, 13], dtype=np.int64))


def test_fill_rows_and_same_offsets():
    offsets = np.array([-1, 0, 1024, -1], dtype=np.int64)
    host_rows = np.array([7, 8, 9, 10], dtype=np.int64)
    rows = np.zeros(4, dtype=np.int64)
    last = np.full(4, -2, dtype=np.int64)
    assert not same_offsets(offsets, last)
    fill_rows(offsets, host_rows, 100, 256, rows, last)
    assert rows.tolist() == [7, 100, 104, 10]  # pinned: the slot's row; else the host row
    assert same_offsets(offsets, last) and not same_offsets(offsets[:3].copy(), last)
    with pytest.raises(ValueError, match="different sizes"):
        fill_rows(offsets, host_rows[:3], 100, 256, rows, last)
    with pytest.raises(ValueError, match="row_bytes must be > 0"):
        fill_rows(offsets, host_rows, 100, 0, rows, last)


@pytest.mark.parametrize("seed", range(10))
def test_hint_arrays_matches_numpy(seed):
    # Hints as predictors give them: one time for a layer's experts, or one
    # per expert; experts as arrays or lists; the tables are per layer.
    rng = np.random.default_rng(seed)
    tabs = {layer: rng.permutation(EXPERTS).astype(np.int64) + 1000 * layer for layer in range(LAYERS)}
    hints = []
    for _ in range(int(rng.integers(1, 6))):
        layer = int(rng.integers(0, LAYERS))
        ex = rng.choice(EXPERTS, int(rng.integers(0, EXPERTS + 1)), replace=False)
        when = int(rng.integers(0, 50)) if rng.random() < 0.5 else rng.integers(0, 50, ex.shape[0])
        hints.append((layer, ex.tolist() if rng.random() < 0.3 else ex, when))
    ids, times = hint_arrays(hints, tabs)
    ref_ids = np.concatenate([tabs[la][np.asarray(ex, dtype=np.int64)] for la, ex, _ in hints])
    ref_times = np.concatenate([np.full(len(ex), t) if np.isscalar(t) else t for _, ex, t in hints])
    assert ids.dtype == times.dtype == np.int64
    assert np.array_equal(ids, ref_ids) and np.array_equal(times, ref_times)


@pytest.mark.parametrize("expert", [-1, EXPERTS])
def test_hint_arrays_refuses_experts_out_of_range(expert):
    # numpy's own indexing would wrap -1 round to the last expert's id.
    tabs = {0: np.arange(EXPERTS, dtype=np.int64)}
    with pytest.raises(IndexError, match="out of range"):
        hint_arrays([(0, np.array([0, expert]), 3)], tabs)


def test_hint_arrays_refuses_times_of_another_length():
    tabs = {0: np.arange(EXPERTS, dtype=np.int64)}
    with pytest.raises(ValueError, match="2 times for 3 experts"):
        hint_arrays([(0, np.array([0, 1, 2]), np.array([5, 6]))], tabs)


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("as_array", [False, True])
def test_distinct_short_matches_sorted_set(seed, as_array):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 65))  # duplicates and every length up to the limit
    got = rng.integers(0, EXPERTS, n).tolist()
    short = distinct_short(np.array(got, dtype=np.int64) if as_array else got, EXPERTS)
    assert short.dtype == np.int64
    assert short.tolist() == sorted(set(got))


@pytest.mark.parametrize("experts", [[1, EXPERTS], [-1, 2], [2**70], np.array([0, EXPERTS], dtype=np.int64)])
def test_distinct_short_refuses_ids_out_of_range(experts):
    with pytest.raises(ValueError, match=f"must be in 0..{EXPERTS - 1}"):
        distinct_short(experts, EXPERTS)


@pytest.mark.parametrize("experts", [
    list(range(65)),  # longer than its buffer
    [1, 2.0],  # not ints: the general path converts or refuses them
    [1, True],
    [np.int64(3)],
    (1, 2),
    np.array([1, 2], dtype=np.int32),
    np.arange(8, dtype=np.int64)[::2],  # not contiguous
    np.zeros((2, 2), dtype=np.int64),
])
def test_distinct_short_leaves_other_input_to_the_general_path(experts):
    assert distinct_short(experts, 100) is None


def test_distinct_goes_through_the_short_path_and_agrees_with_the_general_one():
    from prefetch.expert_ids import distinct

    assert distinct([5, 1, 5, 0], EXPERTS).tolist() == [0, 1, 5]
    assert distinct(list(range(70)) + [3], 80).tolist() == list(range(70))  # the general path
    assert distinct([1, 2.0, 2], EXPERTS).tolist() == [1, 2]  # floats: the general path's int()
    with pytest.raises(ValueError, match="must be in"):
        distinct([0, 2**70], EXPERTS)


def test_slot_numbers_writes_the_slot_of_each_offset():
    where = np.array([[3 * 512, 0], [0, 0], [7 * 512, 1]], dtype=np.int64)
    out = np.full(5, -9, dtype=np.int64)
    assert slot_numbers(where, 512, out) == 3
    assert out.tolist() == [3, 0, 7, -9, -9]


@pytest.mark.parametrize("where, slot_bytes, size, match", [
    ([[512, 0], [700, 0]], 512, 4, "not on the grid"),
    ([[-512, 0]], 512, 4, "not on the grid"),
    ([[0, 0], [512, 0]], 512, 1, "2 rows for a buffer of 1"),
    ([[0, 0]], 0, 4, "slot_bytes must be > 0"),
])
def test_slot_numbers_refuses_bad_input_and_writes_nothing(where, slot_bytes, size, match):
    out = np.full(size, -9, dtype=np.int64)
    with pytest.raises(ValueError, match=match):
        slot_numbers(np.array(where, dtype=np.int64), slot_bytes, out)
    assert (out == -9).all()


@pytest.mark.parametrize("seed", range(20))
def test_distinct_ids_matches_distinct_then_the_table(seed):
    rng = np.random.default_rng(seed)
    table = np.where(rng.random(EXPERTS) < 0.8, rng.permutation(EXPERTS) + 500, -1).astype(np.int64)
    got = rng.integers(0, EXPERTS, int(rng.integers(0, 20))).tolist()
    routed, ids = distinct_ids(got, EXPERTS, table)
    assert routed.tolist() == sorted(set(got))
    assert ids.tolist() == table[routed].tolist()  # -1 (not registered) passes through: the engine refuses it


def test_distinct_ids_refuses_experts_past_the_table_and_leaves_other_input():
    table = np.arange(4, dtype=np.int64)
    with pytest.raises(ValueError, match="no entry in the layer's table of 4"):
        distinct_ids([1, 5], 8, table)
    with pytest.raises(ValueError, match="must be in 0..7"):
        distinct_ids([8], 8, table)
    assert distinct_ids([1, 2.0], 8, table) is None


@pytest.mark.parametrize("never", [None, np.array([], dtype=np.int64), np.array([0, 3], dtype=np.int64)])
def test_hint_times_matches_numpy(never):
    offset = np.array([0, 5, 2, 9, 1], dtype=np.int64)
    want = offset + 1000
    if never is not None:
        want[never] = -7
    assert hint_times(offset, 1000, never, -7).tolist() == want.tolist()


@pytest.mark.parametrize("never", [np.array([5]), np.array([-1])])
def test_hint_times_refuses_positions_out_of_range(never):
    with pytest.raises(IndexError, match="position"):
        hint_times(np.zeros(5, dtype=np.int64), 1, never.astype(np.int64), -7)


def test_take_ids_matches_numpy_and_refuses_keys_out_of_range():
    table = np.arange(10, dtype=np.int64) * 3 - 1
    keys = np.array([9, 0, 4, 4], dtype=np.int64)
    assert take_ids(table, keys).tolist() == table[keys].tolist()
    for bad in (10, -1):
        with pytest.raises(IndexError, match="out of a table of 10"):
            take_ids(table, np.array([1, bad], dtype=np.int64))


def test_take_ids_ascending_refuses_keys_out_of_order():
    table = np.arange(10, dtype=np.int64)
    assert take_ids(table, np.array([1, 4, 9], dtype=np.int64), True).tolist() == [1, 4, 9]
    for keys in ([1, 4, 4], [4, 1]):
        with pytest.raises(ValueError, match="sorted and distinct"):
            take_ids(table, np.array(keys, dtype=np.int64), True)


@pytest.mark.parametrize("seed", range(10))
def test_plan_pins_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    reads = np.flatnonzero(rng.random(LAYERS * EXPERTS) < 0.3).astype(np.int64)
    answers = np.where(rng.random(reads.shape[0]) < 0.7, rng.integers(0, 50, reads.shape[0]) * 256, -1)
    ids = reads + 1000
    offsets = np.full(LAYERS * EXPERTS, 77, dtype=np.int64)  # stale: every entry is written
    held, bounds = plan_pins(reads, answers, ids, offsets, LAYERS, EXPERTS)
    expected = np.full(LAYERS * EXPERTS, -1, dtype=np.int64)
    expected[reads] = answers
    assert offsets.tolist() == expected.tolist()
    assert held.tolist() == ids[answers >= 0].tolist()
    assert bounds == np.searchsorted(reads, np.arange(LAYERS + 1) * EXPERTS).tolist()


@pytest.mark.parametrize("reads, answers, table, match", [
    ([3, 1], [0, 0], LAYERS * EXPERTS, "sorted, distinct"),
    ([1, 1], [0, 0], LAYERS * EXPERTS, "sorted, distinct"),
    ([LAYERS * EXPERTS], [0], LAYERS * EXPERTS, "sorted, distinct"),
    ([-1], [0], LAYERS * EXPERTS, "sorted, distinct"),
    ([1, 2], [0], LAYERS * EXPERTS, "different sizes"),
    ([1], [0], LAYERS * EXPERTS - 1, "a table of"),
])
def test_plan_pins_refuses_bad_input_and_writes_nothing(reads, answers, table, match):
    offsets = np.full(table, 5, dtype=np.int64)
    reads = np.array(reads, dtype=np.int64)
    with pytest.raises(ValueError, match=match):
        plan_pins(reads, np.array(answers, dtype=np.int64), reads + 1, offsets, LAYERS, EXPERTS)
    assert (offsets == 5).all()
