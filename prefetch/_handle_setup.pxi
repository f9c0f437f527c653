# Included by _engine.pyx: the work of PrefetchHandle.__init__ - the budget
# of each device, the limits and flags checked into CHandleOptions, the copy
# backend, and the arenas the engine's caches live in - with the errors the
# class docstring documents.


cdef list _device_budgets(object device_budget_bytes, object num_devices):
    """One budget per device from ``device_budget_bytes`` (an int, or a list
    or tuple of them) and ``num_devices`` (None, or the device count)."""
    if num_devices is not None:
        num_devices = _int_option("num_devices", num_devices, 1, kMaxDevices)
    if isinstance(device_budget_bytes, (list, tuple)):
        budgets = [
            _int_option(f"device_budget_bytes[{i}]", b, kSlotAlignmentBytes, _INT64_MAX)
            for i, b in enumerate(device_budget_bytes)
        ]
        if not budgets:
            raise InvalidArgumentError("device_budget_bytes needs at least one device")
        if num_devices is not None and num_devices != len(budgets):
            raise InvalidArgumentError(
                f"num_devices={num_devices} disagrees with the "
                f"{len(budgets)} budgets in device_budget_bytes"
            )
        return budgets
    budget = _int_option("device_budget_bytes", device_budget_bytes, kSlotAlignmentBytes,
                         _INT64_MAX)
    return [budget] * (1 if num_devices is None else num_devices)


cdef int _check_limits(CHandleOptions& options, object cycle_acquires,
                       object copy_chunk_bytes, object max_bytes_in_flight,
                       object max_speculative_bytes_in_flight, object copy_lanes,
                       object start_paused, object poison_freed_slots,
                       object debug_issue_delay_us) except -1:
    """Checks the numeric limits and flags, in this order, into `options`
    (debug_issue_delay_us only checked: the caller converts it last)."""
    chunk = _int_option("copy_chunk_bytes", copy_chunk_bytes, 1, _INT64_MAX)
    in_flight = _int_option("max_bytes_in_flight", max_bytes_in_flight, 1, _INT64_MAX)
    lanes = _int_option("copy_lanes", copy_lanes, 1, kMaxCopyLanes)
    cycle = _int_option("cycle_acquires", cycle_acquires, 0, _INT64_MAX)
    speculative = (
        None if max_speculative_bytes_in_flight is None
        else _int_option("max_speculative_bytes_in_flight",
                         max_speculative_bytes_in_flight, 1, _INT64_MAX)
    )
    cdef bint paused = _flag_option("start_paused", start_paused)
    cdef bint poison = _flag_option("poison_freed_slots", poison_freed_slots)
    if (type(debug_issue_delay_us) is _PY_BOOL
            or not isinstance(debug_issue_delay_us, (int, float))):
        raise TypeError("debug_issue_delay_us must be a number of microseconds")
    if not debug_issue_delay_us >= 0:
        raise InvalidArgumentError("debug_issue_delay_us must be >= 0")
    options.cycle_acquires = cycle
    options.copy_chunk_bytes = chunk
    options.max_bytes_in_flight = in_flight
    if speculative is not None:
        options.max_speculative_bytes_in_flight = speculative
    options.copy_lanes = lanes
    options.start_paused = paused
    options.poison_freed_slots = poison
    return 0


cdef str _make_backend(object backend, object faults, int num_devices,
                       shared_ptr[CFaultConfig]& fault_config,
                       unique_ptr[CCopyBackend]& out):
    """Makes the copy backend named `backend` for `num_devices` devices into
    `out` ("fault": with `fault_config` made from `faults`) and returns its
    name; more devices than it has is a ValueError."""
    if backend == "fault":
        fault_config = make_shared[CFaultConfig]()
        for key, value in (faults or {}).items():
            fault_config.get().Set(key.encode(), value)
        out = move(MakeFaultBackend(num_devices, fault_config))
    else:
        if faults is not None:
            raise InvalidArgumentError("faults= needs backend='fault'")
        out = move(MakeBackend(backend.encode(), num_devices))
    name = deref(out).Name().decode()
    if num_devices > deref(out).DeviceCount():
        raise InvalidArgumentError(
            f"{num_devices} devices requested but the {name} backend "
            f"has {deref(out).DeviceCount()}"
        )
    return name


cdef list _make_arenas(str name, list budgets, CHandleOptions& options):
    """One flat uint8 arena per budget (a CUDA tensor from torch's allocator
    on the "cuda" backend, else a numpy array), each put in `options` with
    its budget; returns them (the handle keeps them alive)."""
    arenas = []
    if name == "cuda":
        import torch
        for d, b in enumerate(budgets):
            arenas.append(
                torch.empty(b, dtype=torch.uint8, device=f"cuda:{d}")
            )
    else:
        for b in budgets:
            # SLOT_ALIGNMENT-aligned like a CUDA allocation (the slot grid;
            # prefetch.hf_experts' sync-free path views it with host memory)
            raw = np.empty(b + SLOT_ALIGNMENT, dtype=np.uint8)
            shift = -raw.ctypes.data % SLOT_ALIGNMENT
            arenas.append(raw[shift : shift + b])
    for d, b in enumerate(budgets):
        options.device_budget_bytes.push_back(b)
        address = (
            arenas[d].data_ptr() if name == "cuda"
            else arenas[d].ctypes.data
        )
        options.device_arenas.push_back(<void*><uintptr_t>address)
    return arenas
