/* The order in which torch's CPU sort (torch.sort(ids), not stable) puts int64 ids below its
 * radix sort's threshold, for _native.c's scatter_bags (paramserver/trainer/bags.py says why the
 * order matters: it is the order torch's embedding_bag backward adds a row's terms in).
 *
 * torch's kernel (aten/src/ATen/native/cpu/SortingKernel.cpp) sorts (value, index) pairs with
 * the C++ library's std::sort, comparing values only; its result among equal values is whatever
 * that introsort's partitions leave. Running the same library's std::sort over the same pairs,
 * compared the same way, makes the same moves and so the same permutation. Measured: equal to
 * torch 2.13's for every size tried below 32768, which is where torch switches to fbgemm's
 * radix sort (stable). paramserver/trainer/bags.py checks this at its first use in a process
 * and leaves the backward to torch where the two disagree (another torch build, another
 * library). Compiled as C++ only for std::sort; called from C.
 */
#include <Python.h>

#include <algorithm>
#include <cstdint>

#include "_sort_order.h"

namespace {

struct KeyIndex {
    int64_t key;
    int64_t index;
};

}  // namespace

extern "C" void torch_sort_order(const int64_t *keys, Py_ssize_t count, int64_t *order,
                                 void *workspace) {
    KeyIndex *pairs = static_cast<KeyIndex *>(workspace);
    for (Py_ssize_t i = 0; i < count; i++) pairs[i] = KeyIndex{keys[i], i};
    // Keys only, as torch's comparator for integers: equal keys are left where introsort puts
    // them, and that placement is the point.
    std::sort(pairs, pairs + count,
              [](const KeyIndex &a, const KeyIndex &b) { return a.key < b.key; });
    for (Py_ssize_t i = 0; i < count; i++) order[i] = pairs[i].index;
}
