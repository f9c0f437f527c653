// Maps engine exceptions onto Python exceptions (used as the Cython
// `except +prefetch_raise_py_error` handler). Binding-only: the engine in
// src_cpp never includes Python headers.
#pragma once

#include <Python.h>

#include <exception>
#include <new>

#include "errors.h"

inline void prefetch_raise_py_error() {
  try {
    throw;
  } catch (const prefetch::PrefetchError& e) {
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
    PyErr_SetString(PyExc_MemoryError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception in prefetch");
  }
}
