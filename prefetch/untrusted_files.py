"""Opening and parsing files that are untrusted input (safetensors
checkpoints and their index, routing traces): the pieces both readers need,
each raising its own exception for the caller to word."""
from __future__ import annotations

import os
import stat

__all__ = ["NotRegularFileError", "RepeatedKeyError", "no_repeated_keys", "open_regular"]


class NotRegularFileError(OSError):
    """The path names something other than a regular file (a FIFO, a
    device, a directory)."""


class RepeatedKeyError(Exception):
    """A JSON object gives `key` twice (json keeps the last one)."""

    def __init__(self, key):
        super().__init__(key)
        self.key = key


def open_regular(path):
    """`path` opened for reading as a binary file object. Opened with
    O_NONBLOCK, cleared after the check, so that a FIFO does not block the
    open for good (it waits for a writer); anything but a regular file
    raises NotRegularFileError, and a failed open its OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFileError("not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def no_repeated_keys(pairs) -> dict:
    """json's object_pairs_hook: the object as a dict, RepeatedKeyError for
    a key given twice."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise RepeatedKeyError(key)
        out[key] = value
    return out
