// Maps engine exceptions onto Python exceptions (used as the Cython
// `except +prefetch_raise_py_error` handler). Binding-only: the engine in
// src_cpp never includes Python headers.
#pragma once

#include <Python.h>

#include <cstring>
#include <exception>
#include <new>

#include "errors.h"

// The exception class of each ErrorKind (prefetch.errors.BY_KIND, in the
// enum's order), set once when the module is imported; until then (and for
// a kind without one) the builtin below.
constexpr int kPrefetchErrorTypes = 16;  // room for every ErrorKind
inline PyObject* g_prefetch_error_types[kPrefetchErrorTypes] = {nullptr};

inline void prefetch_set_error_type(int kind, PyObject* type) {
  if (kind < 0 || kind >= kPrefetchErrorTypes) return;
  Py_XINCREF(type);
  Py_XDECREF(g_prefetch_error_types[kind]);
  g_prefetch_error_types[kind] = type;
}

// An OSError subclass with the errno of a failed system call is built as
// type(errno, message), so the exception's .errno is set (a message that is
// not UTF-8, from a file name, keeps its bytes as escapes); anything else as
// type(message).
inline void prefetch_set_error(PyObject* type, const prefetch::PrefetchError& e) {
  if (e.sys_errno() != 0 && PyType_Check(type) &&
      PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(type),
                       reinterpret_cast<PyTypeObject*>(PyExc_OSError))) {
    const char* what = e.what();
    PyObject* msg = PyUnicode_DecodeUTF8(what, static_cast<Py_ssize_t>(std::strlen(what)),
                                         "backslashreplace");
    PyObject* exc = msg == nullptr ? nullptr : PyObject_CallFunction(type, "iO", e.sys_errno(), msg);
    Py_XDECREF(msg);
    if (exc != nullptr) {
      PyErr_SetObject(type, exc);
      Py_DECREF(exc);
    }  // else: the failed call's own error (a MemoryError) is set
    return;
  }
  PyErr_SetString(type, e.what());
}

inline void prefetch_raise_py_error() {
  try {
    throw;
  } catch (const prefetch::PrefetchError& e) {
    const int kind = static_cast<int>(e.kind());
    if (kind >= 0 && kind < kPrefetchErrorTypes && g_prefetch_error_types[kind] != nullptr) {
      prefetch_set_error(g_prefetch_error_types[kind], e);
      return;
    }
    PyObject* type = PyExc_RuntimeError;
    switch (e.kind()) {
      case prefetch::ErrorKind::kInvalidArgument: type = PyExc_ValueError; break;
      case prefetch::ErrorKind::kUnknownId: type = PyExc_KeyError; break;
      case prefetch::ErrorKind::kAlreadyExists: type = PyExc_ValueError; break;
      case prefetch::ErrorKind::kTimeout: type = PyExc_TimeoutError; break;
      case prefetch::ErrorKind::kOutOfMemory: type = PyExc_MemoryError; break;
      case prefetch::ErrorKind::kClosed:
      case prefetch::ErrorKind::kCopyFailed:
      case prefetch::ErrorKind::kState:
      case prefetch::ErrorKind::kUnavailable: type = PyExc_RuntimeError; break;
      case prefetch::ErrorKind::kIoError: type = PyExc_OSError; break;
    }
    prefetch_set_error(type, e);
  } catch (const std::bad_alloc& e) {
    PyObject* oom = g_prefetch_error_types[static_cast<int>(prefetch::ErrorKind::kOutOfMemory)];
    PyErr_SetString(oom != nullptr ? oom : PyExc_MemoryError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception in prefetch");
  }
}
