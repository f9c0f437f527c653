// Maps engine exceptions onto Python exceptions (used as the Cython
// `except +prefetch_raise_py_error` handler). Binding-only: the engine in
// src_cpp never includes Python headers.
#pragma once

#include <Python.h>

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

inline void prefetch_raise_py_error() {
  try {
    throw;
  } catch (const prefetch::PrefetchError& e) {
    const int kind = static_cast<int>(e.kind());
    if (kind >= 0 && kind < kPrefetchErrorTypes && g_prefetch_error_types[kind] != nullptr) {
      PyErr_SetString(g_prefetch_error_types[kind], e.what());
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
    }
    PyErr_SetString(type, e.what());
  } catch (const std::bad_alloc& e) {
    PyObject* oom = g_prefetch_error_types[static_cast<int>(prefetch::ErrorKind::kOutOfMemory)];
    PyErr_SetString(oom != nullptr ? oom : PyExc_MemoryError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception in prefetch");
  }
}
