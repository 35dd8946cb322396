/* _tensors.cpp's functions, for _native.c (C) and itself (C++): a torch tensor's memory as
 * a Py_buffer, so the loops take the tensors a trainer and a server hold as they
 * are (Tensor.numpy() costs thousands of instructions a call; this, tens). */
#ifndef PARAMSERVER_TENSORS_H
#define PARAMSERVER_TENSORS_H

#include <Python.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Where `object` is a torch tensor: fills `view` as PyObject_GetBuffer would with `flags`
 * (CPU, strided, of a dtype with a buffer format; contiguous unless `flags` ask for strides;
 * writable whatever they ask: a tensor's memory always is) and returns 1, or sets TypeError
 * and returns -1. Returns 0, touching nothing, where `object` is not a tensor. */
__attribute__((visibility("hidden"))) int tensor_buffer(PyObject *object, Py_buffer *view,
                                                        int flags);

/* Releases a view tensor_buffer filled and returns 1; returns 0 for any other view. */
__attribute__((visibility("hidden"))) int tensor_buffer_release(Py_buffer *view);

/* A frame's tensors (paramserver/wire/frames.py; native.py says what each does). */
__attribute__((visibility("hidden"))) PyObject *frame_tensor(PyObject *self,
                                                             PyObject *const *args,
                                                             Py_ssize_t nargs);
__attribute__((visibility("hidden"))) PyObject *small_data(PyObject *self, PyObject *args);
__attribute__((visibility("hidden"))) PyObject *joined_tensors(PyObject *self, PyObject *arg);
__attribute__((visibility("hidden"))) PyObject *frame_small_tensor(PyObject *self,
                                                                   PyObject *args);
__attribute__((visibility("hidden"))) PyObject *are_rows(PyObject *self, PyObject *args);
/* A record pass's lookups: each table's unique ids and each lookup's positions among them
 * (paramserver/native.py's unique_lookups). */
__attribute__((visibility("hidden"))) PyObject *unique_lookups(PyObject *self, PyObject *groups);

/* _native.c's, for unique_lookups: one segment's sorted unique ids and each id's index
 * among them (returns how many are unique), with a workspace of unique_workspace_bytes of the
 * largest segment. */
__attribute__((visibility("hidden"))) Py_ssize_t unique_ids(const int64_t *ids, Py_ssize_t count,
                                                            void *workspace, int64_t *unique,
                                                            int64_t *inverse);
__attribute__((visibility("hidden"))) size_t unique_workspace_bytes(Py_ssize_t largest);

/* A mapping's values as one bundle's shapes and flat tensor (paramserver/wire/bundles.py). */
__attribute__((visibility("hidden"))) PyObject *bundle_values(PyObject *self,
                                                              PyObject *const *args,
                                                              Py_ssize_t nargs);

/* A bundle's views by name, or what is wrong with it (paramserver/wire/bundles.py). */
__attribute__((visibility("hidden"))) PyObject *unbundled_views(PyObject *self,
                                                                PyObject *const *args,
                                                                Py_ssize_t nargs);

/* A message's tensor data (paramserver/wire/sizing.py's payload_size). */
__attribute__((visibility("hidden"))) PyObject *payload_sizes(PyObject *self,
                                                              PyObject *const *args,
                                                              Py_ssize_t nargs);

#ifdef __cplusplus
}
#endif

#endif
