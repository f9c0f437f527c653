# Included by _engine.pyx: the plumbing PrefetchHandle's calls share - a
# stream handle per device, ``step``'s arrays and streams put into
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


cdef int64_t[::1] _pin_offsets(object pin_into, Py_ssize_t n):
    """``step``'s ``pin_into`` as a writable int64 view of `n` places."""
    if pin_into is None:
        raise InvalidArgumentError("pin needs pin_into (an int64 array as long as pin)")
    cdef int64_t[::1] out = pin_into
    if out.shape[0] != n:
        raise InvalidArgumentError(f"pin_into has {out.shape[0]} places for "
                                   f"{n} pin ids")
    return out


cdef int _step_streams(object backend, int num_devices, object stream,
                       CStepArgs& args, vector[uintptr_t]& streams,
                       vector[uintptr_t]& release_streams) except -1:
    """``step``'s streams into `args` (kept in the two vectors): the acquire
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
