# Included by _engine.pyx: _HandleRegistry, between _HandleBase and
# PrefetchHandle (each class's only subclass) - every way a tensor gets
# into the engine and out of it: host bytes copied in (register,
# register_parts), caller memory used in place (register_external),
# disk-backed tensors read through the host tier (open_file, file_info,
# register_disk), and unregister and ``in``.


cdef class _HandleRegistry(_HandleBase):
    """The registration calls of PrefetchHandle, its only subclass (see its
    docstring); not for use on its own."""

    # ------------------------------------------------------------ registry

    def register(self, tensor_id, data, *, device=0):
        """Copies the bytes of `data` into engine-owned host memory as
        `tensor_id`. `data` is bytes, a buffer, a numpy array or a CPU torch
        tensor; it is read once and may be freed afterwards."""
        self.register_parts(tensor_id, [(data, 0)], device=device)

    def register_parts(self, tensor_id, parts, *, total_bytes=None, device=0):
        """Registers one tensor assembled from `parts`, a list of
        ``(data, byte_offset)`` pairs (packing one expert's weights into one
        buffer: one copy instead of several). Bytes no part covers are zero.
        ``total_bytes`` defaults to the end of the last part."""
        self._check_open()
        cdef int64_t tid = _as_single_id(tensor_id)
        arrays = []
        offsets = []
        end = 0
        for item in parts:
            data, offset = item
            offset = operator.index(offset)
            if offset < 0:
                raise InvalidArgumentError("part offsets must be >= 0")
            arr = _as_byte_array(data)
            arrays.append(arr)
            offsets.append(offset)
            end = max(end, offset + arr.shape[0])
        total = end if total_bytes is None else operator.index(total_bytes)
        if total < 0:
            raise InvalidArgumentError("total_bytes must be >= 0")
        cdef int dev = operator.index(device)
        cdef vector[CHostPart] cparts
        cdef CHostPart part
        cdef const unsigned char[::1] view
        for arr, offset in zip(arrays, offsets):
            if arr.shape[0] == 0:
                continue
            view = arr
            part.src = &view[0]
            part.bytes = arr.shape[0]
            part.offset = offset
            cparts.push_back(part)
        cdef size_t ctotal = total
        with nogil:
            self._c.RegisterTensor(
                tid, ctotal, dev, cparts.data(), cparts.size()
            )

    def register_external(self, tensor_id, data, *, device=0):
        """Registers `data` (a contiguous CPU torch tensor or numpy array)
        without copying it: the engine copies straight from its memory. The
        handle keeps a reference to `data` until unregister or close; do not
        change its bytes meanwhile. On CUDA, page-locked memory (e.g.
        ``torch.empty(..., pin_memory=True)``) gives full-speed copies."""
        self._check_open()
        cdef int64_t tid = _as_single_id(tensor_id)
        cdef uintptr_t address
        cdef size_t nbytes
        if _is_torch_tensor(data):
            if data.device.type != "cpu" or not data.is_contiguous():
                raise InvalidArgumentError("register_external needs a contiguous CPU tensor")
            address = data.data_ptr()
            nbytes = data.numel() * data.element_size()
        elif isinstance(data, np.ndarray):
            if not data.flags.c_contiguous:
                raise InvalidArgumentError("register_external needs a C-contiguous array")
            address = data.ctypes.data
            nbytes = data.nbytes
        else:
            raise TypeError(
                "register_external needs a CPU torch tensor or a numpy array, "
                f"got {type(data).__name__}"
            )
        cdef int dev = operator.index(device)
        with nogil:
            self._c.RegisterExternal(tid, <const void*>address, nbytes, dev)
        self._external[tid] = data

    def unregister(self, tensor_id):
        """Forgets a tensor (it must not be acquired or mid-copy)."""
        self._check_open()
        cdef int64_t tid = _as_single_id(tensor_id)
        with nogil:
            self._c.UnregisterTensor(tid)
        self._external.pop(tid, None)

    def __contains__(self, tensor_id):
        """``tensor_id in handle``: whether the id is registered (False for
        anything that is not a valid id, and after close)."""
        if self._closed or type(tensor_id) is _PY_BOOL:
            return False
        try:
            tid = operator.index(tensor_id)
        except TypeError:
            return False
        if tid < 0 or tid > kMaxTensorId:
            return False
        cdef int64_t ctid = tid
        cdef bint found
        with nogil:
            found = self._c.IsRegistered(ctid)
        return found

    # ------------------------------------------ disk-backed tensors

    def open_file(self, path):
        """Opens `path` for disk-backed tensors (``register_disk``) and
        returns its file index. The file stays open until close. A missing
        or unreadable file raises DiskReadError (an OSError with its
        errno); the size and modification time are recorded now, and every
        read checks the file is still the one opened."""
        self._check_open()
        if not isinstance(path, (str, bytes)) and not hasattr(path, "__fspath__"):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        cdef string cpath = os.fsencode(path)
        cdef int32_t index
        with nogil:
            index = self._c.OpenFile(cpath)
        return index

    def file_info(self, file):
        """The file `file` (from ``open_file``) as it was opened: a dict of
        path, direct (O_DIRECT or buffered), alignment (1 when buffered),
        size, mtime_ns, inode, device. Check a file against what you
        expect here, after ``open_file``: a file replaced between a
        ``stat`` and the open would pass a check made before it."""
        self._check_open()
        cdef int32_t f = _int_option("file", file, 0, (1 << 31) - 1)
        cdef CDiskFileInfo info
        with nogil:
            info = self._c.FileInfo(f)
        return {"path": os.fsdecode(bytes(info.path)), "direct": info.direct,
                "alignment": info.alignment, "size": info.size, "mtime_ns": info.mtime_ns,
                "inode": info.inode, "device": info.device}

    def register_disk(self, tensor_id, extents, *, total_bytes=None, device=0):
        """Registers `tensor_id` as bytes read from files (Note [Host tier]):
        `extents` is a list of ``(file, file_offset, nbytes, tensor_offset)``
        (``file`` from ``open_file``); bytes no extent covers read as zero.
        ``total_bytes`` defaults to the end of the last extent. Nothing is
        read now: a copy of the tensor reads its extents into the host tier,
        then copies them to the device. Needs ``host_budget_bytes`` > 0."""
        self._check_open()
        cdef int64_t tid = _as_single_id(tensor_id)
        cdef vector[CDiskExtent] cext
        cdef CDiskExtent x
        end = 0
        for item in extents:
            if len(item) != 4:
                raise InvalidArgumentError(
                    "each extent is (file, file_offset, nbytes, tensor_offset)")
            values = [_int_option(name, v, 0, _UINT64_MAX)
                      for name, v in zip(("file", "file_offset", "nbytes", "tensor_offset"), item)]
            if values[0] > 2**31 - 1:
                raise InvalidArgumentError(f"no file {values[0]}")
            x.file, x.file_offset, x.bytes, x.tensor_offset = values
            cext.push_back(x)
            end = max(end, values[3] + values[2])
        total = (end if total_bytes is None
                 else _int_option("total_bytes", total_bytes, 0, _UINT64_MAX))
        if total > _UINT64_MAX:
            raise InvalidArgumentError(f"the extents end past 2**64 bytes ({total})")
        cdef size_t ctotal = total
        cdef int dev = operator.index(device)
        with nogil:
            self._c.RegisterDisk(tid, cext.data(), cext.size(), ctotal, dev)
