# Included by _engine.pyx: the plumbing PrefetchHandle's calls share - a
# stream handle per device, ``exchange``'s arrays and streams put into
# CStepArgs, and the (offset, device) table acquired slots are returned as.


cdef vector[uintptr_t] _device_streams(object backend, int num_devices,
                                       object stream, bint for_release):
    """One stream handle per device (kNoStream = none; 0 is CUDA's legacy
    default stream, torch's default stream, and a real one). `stream` is
    None, one stream (for the device it belongs to; device 0 when that
    is unknown), or a dict device -> stream. On the CUDA backend a
    release without a stream for a device uses torch's current stream
    there, so a slot is never reused under a kernel still reading it.
    The host backend has no streams: it refuses one rather than ignore
    it (a raw int there is a caller's mistake, not a request to wait)."""
    if backend == "host" and stream is not None and stream != {}:
        raise InvalidArgumentError(
            "the host backend has no streams: pass stream=None (got "
            f"{type(stream).__name__} {stream!r}); streams are for "
            "backend='cuda'"
        )
    cdef vector[uintptr_t] out
    out.resize(num_devices, kNoStream)
    if isinstance(stream, dict):
        for device, s in stream.items():
            d = operator.index(device)
            if d < 0 or d >= num_devices:
                raise InvalidArgumentError(f"no device {d} for a stream")
            out[d] = _stream_handle(s)
    elif stream is not None:
        device = getattr(getattr(stream, "device", None), "index", None)
        d = 0 if device is None else device
        if d < 0 or d >= num_devices:
            raise InvalidArgumentError(f"stream is on device {d}, not one of ours")
        out[d] = _stream_handle(stream)
    if for_release and backend == "cuda":
        import torch
        for d in range(num_devices):
            if out[d] == kNoStream:
                out[d] = torch.cuda.current_stream(d).cuda_stream
    return out


cdef const int64_t[::1] _step_ids(object tensor_ids, const int64_t** first,
                                  size_t* n):
    """``tensor_ids`` as an int64 view (keep it while the engine reads it),
    its first id's address in `first` and its length in `n` when not empty."""
    cdef const int64_t[::1] ids = as_id_array(tensor_ids)
    if ids.shape[0] > 0:
        first[0] = &ids[0]
        n[0] = ids.shape[0]
    return ids


cdef int _own_ids(object tensor_ids, vector[int64_t]& own, const int64_t** first,
                  size_t* n) except -1:
    """``tensor_ids`` copied into `own` (Note [Ids copied for a wait]), the
    copy's first id's address in `first` and its length in `n` when not
    empty."""
    cdef const int64_t[::1] ids = as_id_array(tensor_ids)
    if ids.shape[0] > 0:
        own.assign(&ids[0], &ids[0] + ids.shape[0])
        first[0] = own.data()
        n[0] = own.size()
    return 0


cdef object _step_hints(object hint_ids, object hint_when, CStepArgs& args):
    """``exchange``'s hints into `args`: ``hint_ids`` read next at
    ``hint_when`` (``hint_next_use``'s forms). Returns the arrays `args`
    points into, for the caller to keep while the engine reads them."""
    if hint_ids is None:
        if hint_when is not None:
            raise InvalidArgumentError("hint_when needs hint_ids")
        return None
    ids = as_id_array(hint_ids)
    cdef const int64_t[::1] ids_v = ids
    times = _hint_times(hint_when, ids_v.shape[0], "hint_when", "ids")
    cdef const int64_t[::1] when = times
    if ids_v.shape[0] > 0:
        args.hint_ids = &ids_v[0]
        args.hint_when = &when[0]
        args.n_hint = ids_v.shape[0]
    return ids, times


cdef int64_t[::1] _step_pins(object pin_ids, object pin_into, CStepArgs& args):
    """``exchange``'s pins into `args`: `pin_ids` (as_id_array's, or None),
    and ``pin_into`` (a writable int64 array as long) for their offsets.
    Returns pin_into's view (None without pins), for the caller to hold
    while the engine writes to it, which also keeps the buffer from being
    resized under the GIL-free call."""
    if pin_ids is None:
        if pin_into is not None:
            raise InvalidArgumentError("pin_into needs pin")
        return None
    cdef const int64_t[::1] ids = pin_ids
    if pin_into is None:
        raise InvalidArgumentError("pin needs pin_into (an int64 array as long as pin)")
    cdef int64_t[::1] out = pin_into
    if out.shape[0] != ids.shape[0]:
        raise InvalidArgumentError(f"pin_into has {out.shape[0]} places for "
                                   f"{ids.shape[0]} pin ids")
    if ids.shape[0] > 0:
        args.pin_ids = &ids[0]
        args.n_pin = ids.shape[0]
        args.pin_offsets = &out[0]
    return out


cdef int _step_streams(object backend, int num_devices, object stream,
                       CStepArgs& args, vector[uintptr_t]& streams,
                       vector[uintptr_t]& release_streams) except -1:
    """``exchange``'s streams into `args` (kept in the two vectors): the acquire
    and pin streams, and the release streams, which on the CUDA backend
    default to torch's current streams."""
    if stream is not None or args.n_release > 0:
        streams = _device_streams(backend, num_devices, stream, False)
        args.streams = streams.data()
        if args.n_release > 0:
            if stream is None and backend == "cuda":
                release_streams = _device_streams(backend, num_devices, stream, True)
                args.release_streams = release_streams.data()
            else:
                args.release_streams = streams.data()
    return 0


cdef int _fill_slot_table(object out, const vector[CSlotInfo]& slots) except -1:
    """Row i of `out` (an int64 array of shape (len(slots), 2)): the byte
    offset of slot i in its device's arena, and that device."""
    cdef int64_t[:, ::1] where = out
    cdef size_t i
    for i in range(slots.size()):
        where[i, 0] = <int64_t>slots[i].offset
        where[i, 1] = slots[i].device
    return 0
