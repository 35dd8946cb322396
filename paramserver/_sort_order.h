/* _sort_order.cpp's one function, for _native.c (C) and itself (C++). */
#ifndef PARAMSERVER_SORT_ORDER_H
#define PARAMSERVER_SORT_ORDER_H

#include <Python.h>
#include <stdint.h>

/* From this many ids on, torch sorts int64 ids with fbgemm's radix sort, which is stable
 * (at::internal::GRAIN_SIZE in aten/src/ATen/native/cpu/SortingKernel.cpp's choice). */
#define TORCH_RADIX_SORT_FROM 32768

#ifdef __cplusplus
extern "C" {
#endif

/* order[0..count) := the permutation that std::sort over (keys[i], i) pairs, compared by key
 * only, puts the pairs in: torch.sort(keys).indices below TORCH_RADIX_SORT_FROM ids.
 * `workspace`: room for `count` pairs of int64 (16 bytes each). Allocates nothing, raises
 * nothing, needs no GIL. */
__attribute__((visibility("hidden"))) void torch_sort_order(const int64_t *keys,
                                                            Py_ssize_t count, int64_t *order,
                                                            void *workspace);

#ifdef __cplusplus
}
#endif

#endif
