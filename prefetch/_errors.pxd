# The error translator both extensions share (prefetch/_errors.h): every
# call that can throw is `except +prefetch_raise_py_error`, which turns a
# C++ PrefetchError into the class of prefetch.errors its kind maps to (the
# module registers them with prefetch_set_error_type when it is imported).
cdef extern from "_errors.h":
    void prefetch_raise_py_error()
    void prefetch_set_error_type(int kind, object type)
