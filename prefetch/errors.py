"""The exceptions prefetch raises.

Every error of the engine is a ``PrefetchError``; each subclass also derives
from a builtin: the one prefetch raised before the family existed
(ValueError, KeyError, TimeoutError, MemoryError, RuntimeError), or OSError
for the disk reader's I/O errors, so ``except`` clauses written for the
builtins keep working, while a caller can now tell, say, a failed
copy from a closed handle without reading the message (pyarrow's
``ArrowInvalid(ValueError, ArrowException)`` is the model). docs/errors.md
lists which call raises which.
"""

__all__ = [
    "PrefetchError",
    "InvalidArgumentError",
    "UnknownIdError",
    "AlreadyRegisteredError",
    "AcquireTimeoutError",
    "HandleClosedError",
    "CopyFailedError",
    "OutOfMemoryError",
    "StateError",
    "BackendUnavailableError",
    "CheckpointError",
    "DiskReadError",
]


class PrefetchError(Exception):
    """Base of every exception the engine raises."""


class InvalidArgumentError(PrefetchError, ValueError):
    """A malformed argument: a bad band, size, option, stream or hint, or an
    acquire that can never fit in the cache."""


class UnknownIdError(PrefetchError, KeyError):
    """A tensor id that is not registered."""

    def __str__(self) -> str:
        # KeyError's str() quotes its argument (it is meant to be a key); this
        # one's argument is a message.
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class AlreadyRegisteredError(PrefetchError, ValueError):
    """A tensor id registered twice."""


class AcquireTimeoutError(PrefetchError, TimeoutError):
    """A wait (an acquire, a close) ran past its deadline."""


class HandleClosedError(PrefetchError, RuntimeError):
    """The handle was closed (or is used in a forked child)."""


class CopyFailedError(PrefetchError, RuntimeError):
    """The copy of this id failed in the backend; other ids are unaffected."""


class OutOfMemoryError(PrefetchError, MemoryError):
    """An allocation of host or device memory failed."""


class StateError(PrefetchError, RuntimeError):
    """A call not valid in the entry's state (a release without an acquire,
    unregistering an id in use)."""


class BackendUnavailableError(PrefetchError, RuntimeError):
    """The copy backend cannot run on this machine (no CUDA driver, ...)."""


class CheckpointError(PrefetchError, ValueError):
    """A checkpoint file or folder that is not what it claims: a malformed
    safetensors header, a shard missing or outside the folder, a file
    changed since it was indexed, a short read (prefetch.checkpoint). Raised
    by Python, not by the engine: no ErrorKind."""


class DiskReadError(PrefetchError, OSError):
    """A file the disk reader (prefetch.DiskReader) could not open or read:
    a missing file, a failed read (``errno`` set, EIO and the like), a short
    read, a file changed, replaced or removed since it was opened. Only that
    read fails; the reader keeps serving the others. ``errno`` is None when
    no system call failed (a short read, a changed file)."""


# In the order of prefetch::ErrorKind (src_cpp/errors.h): the binding maps a
# kind to the class at its index.
BY_KIND = (
    InvalidArgumentError,
    UnknownIdError,
    AlreadyRegisteredError,
    AcquireTimeoutError,
    HandleClosedError,
    CopyFailedError,
    OutOfMemoryError,
    StateError,
    BackendUnavailableError,
    DiskReadError,
)
