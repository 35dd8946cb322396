/* _tensor_buffer.cpp's two functions, for _native.c (C) and itself (C++): a torch tensor's
 * memory as a Py_buffer, so the loops take the tensors a trainer and a server hold as they
 * are (Tensor.numpy() costs thousands of instructions a call; this, tens). */
#ifndef PARAMSERVER_TENSOR_BUFFER_H
#define PARAMSERVER_TENSOR_BUFFER_H

#include <Python.h>

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

#ifdef __cplusplus
}
#endif

#endif
