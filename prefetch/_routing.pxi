# Host bookkeeping of the sync-free decode path (prefetch/offload/sync_free.py), in
# C: inside `generate` each numpy call on a cold cache cost 5-15 us on the
# development VM, and reading a step's routings back took ten of them (58 us
# a step with the routings already on the host). These loops are over a
# model's (layer, expert) table: 1,024 entries for OLMoE-1B-7B.
from libc.stdint cimport uint8_t
from libc.string cimport memmove, memset


@cython.boundscheck(False)
@cython.wraparound(False)
def read_routed(list routings, const int64_t[::1] host, int64_t num_experts, uint8_t[::1] routed,
                const uint8_t[::1] pinned, const uint8_t[::1] owned, const int64_t[::1] ids,
                uint8_t[::1] seen=None):
    """One read of a step's routings: `routings` is the list of (layer,
    step, tensor, count) that `host` (every count's expert ids, in order)
    came from; `routed`, `pinned`, `owned` and `ids` are flat [layers x
    experts] tables (entry layer * num_experts + expert; owned None: all).
    Sets `routed` to the routed (layer, expert) pairs and returns (ids of
    the routed pairs owned here, ids of those of them not pinned, hits,
    misses, misses of pairs set in `seen`), in table order. `seen` (None:
    not kept, the last count 0): the pairs read before, which then gets
    this read's routed pairs too, owned here or not. An id or layer out of
    range raises ValueError before anything is written."""
    cdef Py_ssize_t n = routed.shape[0]
    if (pinned.shape[0] != n or ids.shape[0] != n or (owned is not None and owned.shape[0] != n)
            or (seen is not None and seen.shape[0] != n)):
        raise ValueError("read_routed: tables of different sizes")
    cdef Py_ssize_t pos = 0, count, base, i, j
    for r in routings:
        count = r[3]
        base = <Py_ssize_t>r[0] * num_experts
        if count < 0 or pos + count > host.shape[0] or base < 0 or base + num_experts > n:
            raise ValueError(f"read_routed: layer {r[0]} or count {count} out of range")
        for j in range(pos, pos + count):
            if host[j] < 0 or host[j] >= num_experts:
                raise ValueError(f"read_routed: expert {host[j]} out of range [0, {num_experts})")
        pos += count
    if pos != host.shape[0]:
        raise ValueError(f"read_routed: {host.shape[0]} routed ids for counts summing to {pos}")
    memset(&routed[0], 0, n)
    pos = 0
    for r in routings:
        count = r[3]
        base = <Py_ssize_t>r[0] * num_experts
        for j in range(pos, pos + count):
            routed[base + host[j]] = 1
        pos += count
    cdef Py_ssize_t n_use = 0, n_miss = 0, n_again = 0
    for i in range(n):
        if routed[i]:
            if owned is None or owned[i]:
                n_use += 1
                if not pinned[i]:
                    n_miss += 1
                    if seen is not None and seen[i]:
                        n_again += 1
            if seen is not None:
                seen[i] = 1
    use = np.empty(n_use, dtype=np.int64)
    fetch = np.empty(n_miss, dtype=np.int64)
    cdef int64_t[::1] use_v = use
    cdef int64_t[::1] fetch_v = fetch
    cdef Py_ssize_t u = 0, f = 0
    for i in range(n):
        if routed[i] and (owned is None or owned[i]):
            use_v[u] = ids[i]
            u += 1
            if not pinned[i]:
                fetch_v[f] = ids[i]
                f += 1
    return use, fetch, n_use - n_miss, n_miss, n_again


@cython.boundscheck(False)
@cython.wraparound(False)
def mark_pinned(const int64_t[::1] offsets, uint8_t[::1] pinned, const int64_t[::1] pinned_into,
                const int64_t[::1] ids):
    """After a pin call: `pinned[i]` = `offsets[i]` >= 0 (offsets: every
    expert's slot offset or -1), and returns the ids (`ids[j]`, what was
    asked for) whose pin call answer `pinned_into[j]` is >= 0: those to
    release."""
    cdef Py_ssize_t n = offsets.shape[0], m = ids.shape[0], i, k = 0
    if pinned.shape[0] != n or pinned_into.shape[0] != m:
        raise ValueError("mark_pinned: arrays of different sizes")
    for i in range(n):
        pinned[i] = offsets[i] >= 0
    for i in range(m):
        if pinned_into[i] >= 0:
            k += 1
    held = np.empty(k, dtype=np.int64)
    cdef int64_t[::1] held_v = held
    k = 0
    for i in range(m):
        if pinned_into[i] >= 0:
            held_v[k] = ids[i]
            k += 1
    return held


@cython.boundscheck(False)
@cython.wraparound(False)
def same_offsets(const int64_t[::1] offsets, const int64_t[::1] last):
    """Whether a layer's pinned offsets are those its row map was made from."""
    cdef Py_ssize_t n = offsets.shape[0], i
    if last.shape[0] != n:
        return False
    for i in range(n):
        if offsets[i] != last[i]:
            return False
    return True


@cython.boundscheck(False)
@cython.wraparound(False)
def fill_rows(const int64_t[::1] offsets, const int64_t[::1] host_rows, int64_t arena_row0,
              int64_t row_bytes, int64_t[::1] rows, int64_t[::1] last):
    """A layer's expert -> row map: a pinned expert's (offset >= 0) is its
    slot's row (arena_row0 + offset / row_bytes), another's its host row;
    `last` keeps the offsets it was made from (same_offsets)."""
    cdef Py_ssize_t n = offsets.shape[0], i
    if host_rows.shape[0] != n or rows.shape[0] != n or last.shape[0] != n:
        raise ValueError("fill_rows: arrays of different sizes")
    if row_bytes <= 0:
        raise ValueError(f"fill_rows: row_bytes must be > 0, got {row_bytes}")
    for i in range(n):
        rows[i] = arena_row0 + offsets[i] // row_bytes if offsets[i] >= 0 else host_rows[i]
        last[i] = offsets[i]


@cython.boundscheck(False)
@cython.wraparound(False)
def hint_arrays(list hints, tables):
    """A predictor's hints [(layer, experts, one time or one per expert)]
    as (tensor ids, next-use times), two int64 arrays, in one pass:
    `tables[layer]` maps a layer's expert to its tensor id (the
    prefetcher's tables). An expert outside its layer's table, negative
    ones included, raises IndexError, and a time array of another length
    ValueError, before anything is returned."""
    cdef Py_ssize_t total = 0, j, n, pos = 0
    cdef const int64_t[::1] ex_v
    cdef const int64_t[::1] table_v
    cdef const int64_t[::1] when_v
    cdef int64_t t
    parts = []
    for lyr, ex, when in hints:
        ex_arr = np.ascontiguousarray(ex, dtype=np.int64).reshape(-1)
        table = tables[lyr]
        ex_v = ex_arr
        table_v = table
        n = ex_v.shape[0]
        for j in range(n):
            if ex_v[j] < 0 or ex_v[j] >= table_v.shape[0]:
                raise IndexError(f"hint for layer {lyr}: expert {ex_v[j]} out of range "
                                 f"[0, {table_v.shape[0]})")
        if isinstance(when, (int, np.integer)):
            when_arr = None
        else:
            when_arr = np.ascontiguousarray(when, dtype=np.int64).reshape(-1)
            if when_arr.shape[0] != n:
                raise ValueError(f"hint for layer {lyr}: {when_arr.shape[0]} times for {n} experts")
        parts.append((ex_arr, table, when, when_arr))
        total += n
    ids = np.empty(total, dtype=np.int64)
    times = np.empty(total, dtype=np.int64)
    cdef int64_t[::1] ids_v = ids
    cdef int64_t[::1] times_v = times
    for ex_arr, table, when, when_arr in parts:
        ex_v = ex_arr
        table_v = table
        n = ex_v.shape[0]
        for j in range(n):
            ids_v[pos + j] = table_v[ex_v[j]]
        if when_arr is None:
            t = when
            for j in range(n):
                times_v[pos + j] = t
        else:
            when_v = when_arr
            for j in range(n):
                times_v[pos + j] = when_v[j]
        pos += n
    return ids, times


@cython.boundscheck(False)
@cython.wraparound(False)
cdef Py_ssize_t _sorted_distinct(object experts, int64_t num_experts, int64_t* buf) except -2:
    """Note [Short expert lists in C]
    A layer's routed experts at small batch (or a predictor's guess), a
    list of Python ints or a 1-D int64 array of at most 64 entries, sorted
    and made distinct by insertion into `buf` (64 places) in one pass.
    Returns how many, or -1 for input of another kind (the caller's
    general path takes it). Inside a decode step each numpy call costs
    several times what it does alone (a host-only BM5 replay on the
    development VM: a layer's numpy work took 6.5 us in a loop of its own
    and 25-35 us more than the resident row's inside the step), so a
    layer's id bookkeeping is one C pass here, not a set, a sort and a
    fancy index. An id outside 0..num_experts-1 raises ValueError."""
    cdef Py_ssize_t n, i, j, k = 0
    cdef int64_t v
    cdef const int64_t[::1] arr_v
    if type(experts) is list:
        n = len(<list>experts)
        if n > 64:
            return -1
        for i in range(n):
            item = (<list>experts)[i]
            if type(item) is not int:
                return -1
            if not 0 <= item < num_experts:  # before the C conversion: no OverflowError
                raise ValueError(f"expert ids must be in 0..{num_experts - 1}")
            buf[i] = item
    elif type(experts) is np.ndarray and experts.ndim == 1 and experts.dtype == np.int64 \
            and experts.shape[0] <= 64 and experts.flags.c_contiguous:
        arr_v = experts
        n = arr_v.shape[0]
        for i in range(n):
            buf[i] = arr_v[i]
    else:
        return -1
    for i in range(n):
        v = buf[i]
        if v < 0 or v >= num_experts:
            raise ValueError(f"expert ids must be in 0..{num_experts - 1}")
        # Insertion into the sorted distinct prefix buf[:k].
        j = k
        while j > 0 and buf[j - 1] > v:
            j -= 1
        if j > 0 and buf[j - 1] == v:
            continue
        if j < k:
            memmove(&buf[j + 1], &buf[j], (k - j) * sizeof(int64_t))
        buf[j] = v
        k += 1
    return k


@cython.boundscheck(False)
@cython.wraparound(False)
def distinct_short(object experts, int64_t num_experts):
    """Sorted distinct int64 array of a short list or 1-D int64 array (Note
    [Short expert lists in C]), or None for input of another kind; for
    `prefetch.expert_ids.distinct` (3.6 us a call alone in Python on the
    development VM, 1.0 here)."""
    cdef int64_t buf[64]
    cdef Py_ssize_t k = _sorted_distinct(experts, num_experts, buf), i
    if k < 0:
        return None
    out = np.empty(k, dtype=np.int64)
    cdef int64_t[::1] out_v = out
    for i in range(k):
        out_v[i] = buf[i]
    return out


@cython.boundscheck(False)
@cython.wraparound(False)
def distinct_ids(object experts, int64_t num_experts, const int64_t[::1] table):
    """A layer's routed experts as (sorted distinct experts, their tensor
    ids `table[expert]`), two int64 arrays, in one C pass (Note [Short
    expert lists in C]); None for input `distinct_short` leaves to the
    general path. `table` is the layer's expert -> tensor id table (-1: not
    registered, which the engine refuses); an expert past its end raises
    ValueError, as one past num_experts does."""
    cdef int64_t buf[64]
    cdef Py_ssize_t k = _sorted_distinct(experts, num_experts, buf), i
    if k < 0:
        return None
    if k and buf[k - 1] >= table.shape[0]:
        raise ValueError(f"expert {buf[k - 1]} has no entry in the layer's table "
                         f"of {table.shape[0]}")
    routed = np.empty(k, dtype=np.int64)
    ids = np.empty(k, dtype=np.int64)
    cdef int64_t[::1] routed_v = routed
    cdef int64_t[::1] ids_v = ids
    for i in range(k):
        routed_v[i] = buf[i]
        ids_v[i] = table[buf[i]]
    return routed, ids


@cython.boundscheck(False)
@cython.wraparound(False)
def slot_numbers(const int64_t[:, ::1] where, int64_t slot_bytes, int64_t[::1] out):
    """Cache slot numbers of an acquire's (offset, device) rows when every
    slot holds one expert of `slot_bytes`: out[i] = offset / slot_bytes,
    for each of the n rows, written into the first n entries of `out`
    (a caller's buffer: a page-locked staging array goes to the device in
    one copy). Returns n. An offset off that grid (a handle holding
    tensors of another size) or a too-short `out` raises ValueError before
    anything is written."""
    cdef Py_ssize_t n = where.shape[0], i
    if slot_bytes <= 0:
        raise ValueError(f"slot_bytes must be > 0, got {slot_bytes}")
    if where.shape[1] < 1 or out.shape[0] < n:
        raise ValueError(f"slot_numbers: {n} rows for a buffer of {out.shape[0]}")
    for i in range(n):
        if where[i, 0] < 0 or where[i, 0] % slot_bytes:
            raise ValueError(f"offset {where[i, 0]} is not on the grid of {slot_bytes}-byte slots: "
                             "the handle holds tensors of another size")
    for i in range(n):
        out[i] = where[i, 0] // slot_bytes
    return n


@cython.boundscheck(False)
@cython.wraparound(False)
def hint_times(const int64_t[::1] offset, int64_t now, object never, int64_t no_next_use):
    """The oracle's hint times of one layer (Note [The oracle's plan] in
    prefetch/predictors.py): offset[i] + now, and `no_next_use` at the
    positions in `never` (an int64 array, or None), in one C pass instead
    of three numpy calls (Note [Short expert lists in C]). A position out
    of range raises IndexError before anything is returned."""
    cdef Py_ssize_t n = offset.shape[0], i
    cdef const int64_t[::1] never_v
    times = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] times_v = times
    for i in range(n):
        times_v[i] = offset[i] + now
    if never is not None:
        never_v = never
        for i in range(never_v.shape[0]):
            if never_v[i] < 0 or never_v[i] >= n:
                raise IndexError(f"hint_times: position {never_v[i]} of {n}")
            times_v[never_v[i]] = no_next_use
    return times


@cython.boundscheck(False)
@cython.wraparound(False)
def take_ids(const int64_t[::1] table, const int64_t[::1] keys, bint ascending=False):
    """table[keys] as a new int64 array, in one C pass (the oracle's hint
    keys to tensor ids). A key out of range raises IndexError; with
    `ascending`, keys not strictly ascending raise ValueError."""
    cdef Py_ssize_t n = keys.shape[0], i
    for i in range(n):
        if keys[i] < 0 or keys[i] >= table.shape[0]:
            raise IndexError(f"take_ids: key {keys[i]} out of a table of {table.shape[0]}")
        if ascending and i and keys[i] <= keys[i - 1]:
            raise ValueError("take_ids: keys must be sorted and distinct")
    out = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] out_v = out
    for i in range(n):
        out_v[i] = table[keys[i]]
    return out


@cython.boundscheck(False)
@cython.wraparound(False)
def plan_rows(const int64_t[::1] offsets, int64_t base, const int64_t[::1] routed,
              int64_t[:, ::1] where):
    """A planned layer's rows (Note [Host-routed step pins] in
    prefetch/offload/step_plan.py): where[i] = (offsets[base + routed[i]], 0) for
    each of the n routed experts (the pins' slot offsets of one device, -1
    where not pinned); returns how many are pinned. One C pass instead of
    five numpy calls. An index out of range or a `where` of another shape
    raises before anything is written."""
    cdef Py_ssize_t n = routed.shape[0], i
    cdef int64_t k, pinned = 0
    if where.shape[0] != n or where.shape[1] != 2:
        raise ValueError(f"plan_rows: {n} experts for rows of shape "
                         f"({where.shape[0]}, {where.shape[1]})")
    for i in range(n):
        k = base + routed[i]
        if routed[i] < 0 or k < 0 or k >= offsets.shape[0]:
            raise IndexError(f"plan_rows: entry {k} out of a table of {offsets.shape[0]}")
    for i in range(n):
        k = offsets[base + routed[i]]
        where[i, 0] = k
        where[i, 1] = 0
        if k >= 0:
            pinned += 1
    return pinned


@cython.boundscheck(False)
@cython.wraparound(False)
def plan_pins(const int64_t[::1] reads, const int64_t[::1] pinned_into, const int64_t[::1] ids,
              int64_t[::1] offsets, int64_t num_layers, int64_t num_experts):
    """After a host-routed step plan's pin call (Note [Host-routed step pins]
    in prefetch/offload/step_plan.py): `offsets` (the flat [layers * experts] table)
    set to -1 but at each of the plan's `reads` (sorted flat indices),
    where it takes the call's answer `pinned_into`; returns (the ids of
    `ids`, the pinned tensor ids, whose answer is >= 0: those to release;
    per layer l, reads[bounds[l] : bounds[l + 1]] are its reads, as a
    list). One C pass instead of seven numpy calls. Arrays of other sizes,
    reads out of range or not sorted raise before anything is written."""
    cdef Py_ssize_t n = reads.shape[0], i, k = 0
    cdef int64_t layer
    if num_layers < 1 or num_experts < 1 or offsets.shape[0] != num_layers * num_experts:
        raise ValueError(f"plan_pins: a table of {offsets.shape[0]} for "
                         f"{num_layers} x {num_experts}")
    if pinned_into.shape[0] != n or ids.shape[0] != n:
        raise ValueError("plan_pins: arrays of different sizes")
    for i in range(n):
        if reads[i] < 0 or reads[i] >= offsets.shape[0] or (i and reads[i] <= reads[i - 1]):
            raise ValueError("plan_pins: reads must be sorted, distinct and in "
                             f"0..{offsets.shape[0] - 1}")
    for i in range(offsets.shape[0]):
        offsets[i] = -1
    for i in range(n):
        offsets[reads[i]] = pinned_into[i]
        if pinned_into[i] >= 0:
            k += 1
    held = np.empty(k, dtype=np.int64)
    cdef int64_t[::1] held_v = held
    k = 0
    for i in range(n):
        if pinned_into[i] >= 0:
            held_v[k] = ids[i]
            k += 1
    bounds = [0] * (num_layers + 1)
    i = 0
    for layer in range(num_layers):
        while i < n and reads[i] < (layer + 1) * num_experts:
            i += 1
        bounds[layer + 1] = i
    return held, bounds
