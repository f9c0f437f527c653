# Included by _engine.pyx: turning Python arguments into what the engine
# takes (int64 id arrays, bands, byte buffers, stream handles, timeouts,
# hint times and clocks, options), with the errors the API documents.

# The .pxd cimports libcpp.bool, which shadows the builtin name here.
cdef object _PY_BOOL = builtins.bool
cdef object _INT64 = np.dtype(np.int64)
cdef object _INT64_MAX = np.iinfo(np.int64).max
cdef object _UINT64_MAX = (1 << 64) - 1
cdef double _MAX_TIMEOUT_S = 1e9  # about 31 years (_as_timeout)


cdef inline bint _is_torch_tensor(object obj):
    return type(obj).__module__ == "torch" and hasattr(obj, "is_floating_point")


cdef object _ids_from_sequence(object seq):
    cdef Py_ssize_t n = len(seq)
    out = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] view = out
    cdef Py_ssize_t i
    for i in range(n):
        value = seq[i]
        if type(value) is _PY_BOOL or isinstance(value, np.bool_):
            raise TypeError(
                f"tensor ids must be integers, got a bool at index {i}"
            )
        try:
            index = operator.index(value)
        except TypeError:
            raise TypeError(
                f"tensor ids must be integers, got {type(value).__name__} "
                f"{value!r} at index {i}"
            ) from None
        if index < -_INT64_MAX - 1 or index > _INT64_MAX:
            raise OverflowError(
                f"tensor id {index} at index {i} does not fit in int64"
            )
        view[i] = index
    return out


cdef object _ids_from_ndarray(object arr):
    if arr.ndim != 1:
        raise InvalidArgumentError(
            f"tensor ids must be a 1-D array, got {arr.ndim}-D shape "
            f"{tuple(arr.shape)}"
        )
    kind = arr.dtype.kind
    if kind == "b":
        raise TypeError("tensor ids must be integers, got a bool array")
    if kind == "i":
        return np.ascontiguousarray(arr, dtype=np.int64)
    if kind == "u":
        if arr.size and arr.max() > _INT64_MAX:
            raise OverflowError("a tensor id does not fit in int64")
        return np.ascontiguousarray(arr, dtype=np.int64)
    if kind == "O":
        return _ids_from_sequence(arr.tolist())
    raise TypeError(
        f"tensor ids must be integers, got an array of dtype {arr.dtype}"
    )


cpdef object as_id_array(object tensor_ids):
    """Converts tensor ids to a contiguous 1-D int64 numpy array, losslessly.

    Accepts a list, tuple, range, numpy array or CPU torch tensor of integers.
    Refuses floats and bools (TypeError), values outside int64
    (OverflowError), arrays that are not 1-D (ValueError) and tensors on a
    GPU (ValueError). A contiguous int64 array is returned as is.
    """
    if type(tensor_ids) is np.ndarray:
        if (tensor_ids.dtype is _INT64 and tensor_ids.ndim == 1
                and tensor_ids.flags.c_contiguous):
            return tensor_ids
        return _ids_from_ndarray(tensor_ids)
    if isinstance(tensor_ids, (list, tuple, range)):
        return _ids_from_sequence(tensor_ids)
    if isinstance(tensor_ids, np.ndarray):
        return _ids_from_ndarray(tensor_ids)
    if _is_torch_tensor(tensor_ids):
        if tensor_ids.device.type != "cpu":
            raise InvalidArgumentError(
                f"tensor ids must be on the CPU, got a tensor on "
                f"{tensor_ids.device}; call .cpu() first"
            )
        if tensor_ids.is_floating_point() or tensor_ids.is_complex():
            raise TypeError(
                f"tensor ids must be integers, got {tensor_ids.dtype}"
            )
        if str(tensor_ids.dtype) == "torch.bool":
            raise TypeError("tensor ids must be integers, got torch.bool")
        return _ids_from_ndarray(tensor_ids.detach().contiguous().numpy())
    raise TypeError(
        "tensor ids must be a list, tuple, range, numpy array or CPU torch "
        f"tensor of integers, got {type(tensor_ids).__name__}"
    )


cdef inline int _as_priority(object priority) except -1:
    if type(priority) is _PY_BOOL:
        raise TypeError("priority must be an integer, got a bool")
    try:
        p = operator.index(priority)
    except TypeError:
        raise TypeError(
            f"priority must be an integer, got {type(priority).__name__}"
        ) from None
    if p < 0 or p >= kNumBands:
        raise InvalidArgumentError(
            f"priority must be in 0..{kNumBands - 1} (0 = most urgent), "
            f"got {p}"
        )
    return p


# Note [priority, formerly band]
# How urgent a queued copy is has one public name, ``priority`` (0 most
# urgent .. NUM_BANDS - 1), as in ``prefetch_tensors``; the engine's own
# word for it, a band of its queue, stays inside the C++. Some calls took
# ``band=`` first (``exchange``, then called ``step``, and
# ``cancel_at_or_below``/``cancel_below``): they still take it, as a
# deprecated old name that goes in a later release. Given alone it is
# used, with a DeprecationWarning; given with ``priority`` it is a
# TypeError, since the two could disagree.
class _DefaultPriority:
    """The default of an ``exchange(priority=...)`` left out: the engine's
    default band, told apart from a priority given (which a band= given
    too would contradict)."""

    def __repr__(self):
        return "DEFAULT_PRIORITY"


cdef object _DEFAULT_PRIORITY_ARG = _DefaultPriority()


cdef int _priority_arg(object priority, object band, str call) except -1:
    """The band a call's ``priority`` (or its old name ``band``) names
    (Note [priority, formerly band]); `call` names the call in the errors."""
    if band is None:
        if priority is _DEFAULT_PRIORITY_ARG:
            return kDefaultPrefetchBand
        return _as_priority(priority)
    if priority is not None and priority is not _DEFAULT_PRIORITY_ARG:
        raise TypeError(f"{call}() takes priority= or its old name band=, not both")
    warnings.warn(f"{call}(band=...) is deprecated: write priority=... (band= goes in a "
                  "later release)", DeprecationWarning, stacklevel=1)
    return _as_priority(band)


cdef inline int64_t _as_single_id(object tensor_id) except? -1:
    if type(tensor_id) is _PY_BOOL:
        raise TypeError("a tensor id must be an integer, got a bool")
    try:
        value = operator.index(tensor_id)
    except TypeError:
        raise TypeError(
            f"a tensor id must be an integer, got {type(tensor_id).__name__}"
        ) from None
    if value < -_INT64_MAX - 1 or value > _INT64_MAX:
        raise OverflowError(f"tensor id {value} does not fit in int64")
    return value


cdef object _as_byte_array(object data):
    """A contiguous 1-D uint8 numpy view of `data` (zero-copy when it can)."""
    if _is_torch_tensor(data):
        if data.device.type != "cpu":
            raise InvalidArgumentError(
                f"register needs host bytes, got a tensor on {data.device}"
            )
        flat = data.detach().contiguous().reshape(-1)
        import torch
        return flat.view(torch.uint8).numpy()
    if isinstance(data, np.ndarray):
        arr = np.ascontiguousarray(data).reshape(-1)
        return arr.view(np.uint8)
    try:
        mv = memoryview(data)
    except TypeError:
        raise TypeError(
            "register needs bytes, a buffer, a numpy array or a CPU torch "
            f"tensor, got {type(data).__name__}"
        ) from None
    return np.ascontiguousarray(np.frombuffer(mv.cast("B"), dtype=np.uint8))


cdef uintptr_t _stream_handle(object stream) except? 0:
    handle = getattr(stream, "cuda_stream", stream)
    if type(handle) is _PY_BOOL:
        raise TypeError("a stream must be an int or a torch.cuda.Stream")
    try:
        return operator.index(handle)
    except TypeError:
        raise TypeError(
            "a stream must be None, an int, a torch.cuda.Stream or a dict "
            f"of device -> stream, got {type(stream).__name__}"
        ) from None


cdef double _as_timeout(object timeout) except? -1.0:
    """Seconds, as a double; a finite timeout past about 31 years is taken as
    that (the engine's nanosecond deadline overflowed past 9.2e9 s, and a
    wait meant as 'forever', such as 1e10 or sys.float_info.max, timed out
    at once). Negative, NaN and infinite values go on to the engine, which
    refuses them."""
    if type(timeout) is _PY_BOOL:
        raise TypeError("timeout must be a number of seconds")
    cdef double t = float(timeout)
    if t > _MAX_TIMEOUT_S and t != INFINITY:
        return _MAX_TIMEOUT_S
    return t


cdef int64_t _as_clock(object now) except? -1:
    """A hint clock reading (``now=``): an integer, not a bool."""
    if type(now) is _PY_BOOL:
        raise TypeError("now must be an integer, got a bool")
    return operator.index(now)


cdef object _hint_times(object when, size_t n, str name, str ids):
    """One next-use time per id as an int64 array: ``when`` is None (no known
    next use), one integer time for all `n` ids, or a sequence of `n` times
    (a length mismatch names argument `name` and the `ids`)."""
    if when is None:
        return np.full(n, _INT64_MAX, dtype=np.int64)
    if isinstance(when, (int, np.integer)) and type(when) is not _PY_BOOL:
        return np.full(n, operator.index(when), dtype=np.int64)
    try:
        times = as_id_array(when)
    except TypeError as exc:  # its message is about ids: say which argument this is
        raise TypeError(str(exc).replace("tensor ids", name)) from None
    if <size_t>times.shape[0] != n:
        raise InvalidArgumentError(f"{name} has {times.shape[0]} times for {n} {ids}")
    return times


cdef object _int_option(str name, object value, object low, object high):
    """`value` as a Python int in low..high, or an error naming option `name`
    (floats, bools and strings are refused, not truncated or parsed)."""
    if type(value) is _PY_BOOL or isinstance(value, np.bool_):
        raise TypeError(f"{name} must be an int, got a bool ({value!r})")
    try:
        number = operator.index(value)
    except TypeError:
        hint = " (write 1 << 20 or 1_000_000, not 1e6)" if isinstance(value, float) else ""
        raise TypeError(
            f"{name} must be an int, got {type(value).__name__} {value!r}{hint}"
        ) from None
    if number < low or number > high:
        raise InvalidArgumentError(f"{name} must be in {low}..{high}, got {number}")
    return number


cdef bint _flag_option(str name, object value) except -1:
    if type(value) is _PY_BOOL or isinstance(value, np.bool_):
        return True if value else False
    raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
