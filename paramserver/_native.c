/* Compiled loops for the hot paths that numpy can only do in several passes over memory (see
 * paramserver/native.py, which loads this module and says when each loop is used).
 *
 * - probe: search an id map (paramserver/store/idmap.py) for a batch of ids, one id at a time: a
 *   slot, then its row's record, and on to the next slot until a match or an empty slot.
 * - place: put new ids in the first free slot of their probe sequences, in order.
 * - rehash: rebuild an id map's slot array in a larger (or cleaned) one, one pass over the old.
 * - init_rows: a dynamic table's new rows, values and optimizer state, each row written once.
 * - unique_ids: the sorted unique ids of a batch of ids, and where each id is among them, as
 *   torch.unique(ids, return_inverse=True) gives them: one radix sort (or a pass of marks);
 *   _tensors.cpp's unique_lookups calls it for each table of a trainer's record pass.
 * - gather_rows, scatter_rows: a trainer's lookups of a step in the rows pulled for each table,
 *   and their gradients added back, every table and lookup in one call.
 * - pool_bags, scatter_bags: the same for a trainer's pooled lookups (EmbeddingBag's sum and
 *   mean): each bag's rows summed in torch's order; backward added straight into the rows, each
 *   row's terms in the order torch's backward adds them (that of torch's sort of the ids, which
 *   _sort_order.cpp computes with the same std::sort).
 * - sort_order: that order of some ids alone, for a check that it is torch's.
 * - pack_steps: a request's row ids of every table and server as the wire carries them (each
 *   set's first id and the steps between its ids, in the narrowest integer type), in one call;
 *   unpack_steps: a server's unpacking of them, every set checked and unpacked in one call;
 *   pack_tables and unpack_tables: the same for several tables' ids as one message carries
 *   them to one server, their steps in one buffer.
 * - all_finite, ascending_within: a server's checks of a request's gradients (no NaN or Inf)
 *   and row ids (each set rising, within its table's bounds), every table's in one call.
 * - own_rows: a trainer's own update of the rows it pulled, every table in one call, by the
 *   servers' math for SGD, Adagrad (the same row loops as step_rows) and row-wise Adagrad.
 * - step_rows: a server's update of rows of a table in place, by torch.optim's Adagrad (no lr
 *   decay) or SGD (no momentum): each row's parameters (and sum) read and written once, with
 *   torch's float operations in torch's order (aten/src/ATen/native/cpu/FusedAdagradKernel.cpp;
 *   SGD's add_ with an alpha), so the result is bitwise the same.
 *   torch's loop is compiled for the CPU, so its multiply-adds are rounded once where the CPU
 *   has the instruction: the caller says which rounding matches (paramserver/optim.py finds out).
 *
 * The loops run without the GIL (other threads, a server's RPC threads, go on meanwhile): the
 * arrays stay exported to them until they return, and their owners' locks keep other writers
 * out. Arrays arrive through the buffer protocol, or as torch tensors where the module was
 * built with torch's headers (_tensors.cpp: PARAMSERVER_TENSORS, which the module names
 * TAKES_TENSORS), contiguous (else a TypeError or BufferError); their sizes are checked here,
 * and every index read from the map or given is checked before it is followed, so a bad call
 * raises ValueError instead of reading or writing out of bounds.
 * The module also names MAP_NORESERVE, which Python's mmap module does not (for
 * paramserver/store/growth.py), and TORCH_RADIX_SORT_FROM (see sort_order).
 * Built with -ffp-contract=off: a multiply-add is fused only where written so (fmaf).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#include "_sort_order.h"
#ifdef PARAMSERVER_TENSORS
#include "_tensors.h"
#endif

#define EMPTY_SLOT (-1)
#define IDS_AHEAD 16 /* ids ahead whose slot and record a probe asks memory for early */

/* The home slot of (space, id): Fibonacci hashing of id ^ space * stride (see IdMap._home). */
static inline uint64_t home_slot(int64_t id, int64_t space, uint64_t gamma, uint64_t stride,
                                 int shift) {
    uint64_t key = (uint64_t)id ^ ((uint64_t)space * stride);
    return (key * gamma) >> shift;
}

static inline int64_t read_int(const char *base, Py_ssize_t index, Py_ssize_t itemsize) {
    const char *at = base + index * itemsize;
    switch (itemsize) {
    case 1: return *(const int8_t *)at;
    case 2: { int16_t v; memcpy(&v, at, 2); return v; }
    case 4: { int32_t v; memcpy(&v, at, 4); return v; }
    default: { int64_t v; memcpy(&v, at, 8); return v; }
    }
}

static int valid_itemsize(Py_ssize_t size) {
    return size == 1 || size == 2 || size == 4 || size == 8;
}

/* The slot array's shift for home_slot, or -1 (ValueError set) if its size is no power of 2. */
static int slot_shift(Py_ssize_t num_slots) {
    if (num_slots < 2 || (num_slots & (num_slots - 1)) != 0) {
        PyErr_SetString(PyExc_ValueError, "the slot array's size must be a power of two");
        return -1;
    }
    int bits = 0;
    while (((Py_ssize_t)1 << bits) < num_slots) bits++;
    return 64 - bits;
}

/* `object`'s memory: a torch tensor's (where built with torch), else the buffer protocol's. */
static int get_buffer(PyObject *object, Py_buffer *view, int flags) {
#ifdef PARAMSERVER_TENSORS
    int taken = tensor_buffer(object, view, flags);
    if (taken != 0) return taken < 0 ? -1 : 0;
#endif
    return PyObject_GetBuffer(object, view, flags);
}

static void release_buffer(Py_buffer *view) {
#ifdef PARAMSERVER_TENSORS
    if (tensor_buffer_release(view)) return;
#endif
    PyBuffer_Release(view);
}

/* PyArg_ParseTuple's converters (O&) for a buffer read (readable) or written (writable):
 * what its y* and w* units give, from a tensor too; the parser releases it where a later
 * argument fails, the caller where all succeed. */
static int convert_buffer(PyObject *object, Py_buffer *view, int flags) {
    if (object == NULL) { /* the parser's cleanup */
        release_buffer(view);
        return 1;
    }
    if (get_buffer(object, view, flags) == 0) return Py_CLEANUP_SUPPORTED;
    PyObject *type, *value, *traceback; /* a TypeError, as the y* and w* units raise */
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_Format(PyExc_TypeError, "a contiguous buffer or CPU tensor is required (%S)",
                 value != NULL ? value : Py_None);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    return 0;
}

static int readable(PyObject *object, void *view) {
    return convert_buffer(object, view, PyBUF_SIMPLE);
}

static int writable(PyObject *object, void *view) {
    return convert_buffer(object, view, PyBUF_WRITABLE);
}

/* An optional buffer: None leaves view->buf NULL. */
static int optional_buffer(PyObject *object, Py_buffer *view, int flags) {
    memset(view, 0, sizeof(*view));
    if (object == Py_None) return 0;
    return get_buffer(object, view, flags);
}

static void release(Py_buffer *view) {
    if (view->obj != NULL) release_buffer(view);
}

/* PyArg_ParseTuple's converter for a contiguous buffer (the caller releases it). */
static int buffer_converter(PyObject *object, void *view) {
    if (object == Py_None) {
        PyErr_SetString(PyExc_TypeError, "a buffer is required");
        return 0;
    }
    return optional_buffer(object, view, PyBUF_C_CONTIGUOUS) == 0;
}

/* The layout of a map's rows: one record of `stride` bytes per row, the id (int64) at offset 0,
 * the space (if keyed) at `space_offset` and the payload (if any) at `payload_offset`. */
typedef struct {
    const char *records;
    Py_ssize_t num_rows;
    Py_ssize_t stride;
    Py_ssize_t space_offset; /* -1: not keyed by space */
    Py_ssize_t space_size;
    Py_ssize_t payload_offset; /* -1: no payloads */
} Rows;

static inline int row_matches(const Rows *rows, int32_t row, int64_t id, int64_t space) {
    const char *record = rows->records + (Py_ssize_t)row * rows->stride;
    int64_t held;
    memcpy(&held, record, 8);
    if (held != id) return 0;
    return rows->space_offset < 0 || read_int(record + rows->space_offset, 0,
                                              rows->space_size) == space;
}

static const char probe_doc[] =
    "probe(slots, records, stride, space_offset, space_size, payload_offset, ids, spaces,\n"
    "      gamma, space_stride, rows_out, positions_out, payloads_out)\n"
    "Each id's row (-1: absent), the slot that ended its search, and its row's payload.";

static PyObject *probe(PyObject *self, PyObject *args) {
    Py_buffer slots_view, records_view, ids_view, spaces_view, rows_view, positions_view,
        payloads_view;
    Py_ssize_t stride, space_offset, space_size, payload_offset;
    long long gamma, space_stride;
    PyObject *spaces_object, *payloads_object;
    if (!PyArg_ParseTuple(args, "O&O&nnnnO&OLLO&O&O", readable, &slots_view, readable,
                          &records_view, &stride, &space_offset, &space_size, &payload_offset,
                          readable, &ids_view, &spaces_object, &gamma, &space_stride, writable,
                          &rows_view, writable, &positions_view, &payloads_object))
        return NULL;
    PyObject *result = NULL;
    int have_spaces = optional_buffer(spaces_object, &spaces_view, PyBUF_SIMPLE) == 0;
    int have_payloads = have_spaces && optional_buffer(payloads_object, &payloads_view,
                                                       PyBUF_WRITABLE) == 0;
    if (!have_payloads) goto done;
    Py_ssize_t num_ids = ids_view.len / 8;
    Py_ssize_t num_slots = slots_view.len / 4;
    int shift = slot_shift(num_slots);
    if (shift < 0) goto done;
    Rows rows = {records_view.buf, stride > 0 ? records_view.len / stride : 0, stride,
                 space_offset, space_size, payload_offset};
    int keyed = space_offset >= 0;
    if (stride < 8 || (keyed != (spaces_view.buf != NULL)) ||
        (keyed && space_offset + space_size > stride) || payload_offset + 4 > stride ||
        (keyed && (!valid_itemsize(space_size) || !valid_itemsize(spaces_view.itemsize) ||
                   spaces_view.len / spaces_view.itemsize != num_ids)) ||
        rows_view.len / 8 != num_ids || positions_view.len / 8 != num_ids ||
        (payloads_view.buf != NULL && (payload_offset < 0 || payloads_view.len / 4 != num_ids))) {
        PyErr_SetString(PyExc_ValueError, "probe: arrays of mismatched sizes or layout");
        goto done;
    }
    const int32_t *slots = slots_view.buf;
    const int64_t *ids = ids_view.buf;
    int64_t *rows_out = rows_view.buf, *positions_out = positions_view.buf;
    int32_t *payloads_out = payloads_view.buf;
    uint64_t mask = (uint64_t)num_slots - 1;
#define HOME_OF(i)                                                                           \
    home_slot(ids[i], keyed ? read_int(spaces_view.buf, (i), spaces_view.itemsize) : 0,      \
              (uint64_t)gamma, (uint64_t)space_stride, shift)
    const char *error = NULL; /* set without the GIL, raised with it */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < num_ids; i++) {
        /* Two waits on memory per id (its slot, then the record the slot names), so ask early
         * for the slots of ids two strides ahead and the records of ids one stride ahead. */
        if (i + 2 * IDS_AHEAD < num_ids) __builtin_prefetch(slots + HOME_OF(i + 2 * IDS_AHEAD));
        if (i + IDS_AHEAD < num_ids) {
            int32_t ahead = slots[HOME_OF(i + IDS_AHEAD)];
            if (ahead >= 0 && ahead < rows.num_rows)
                __builtin_prefetch(rows.records + (Py_ssize_t)ahead * stride);
        }
        int64_t space = keyed ? read_int(spaces_view.buf, i, spaces_view.itemsize) : 0;
        uint64_t at = home_slot(ids[i], space, (uint64_t)gamma, (uint64_t)space_stride, shift);
        int64_t found = EMPTY_SLOT;
        Py_ssize_t looked = 0;
        for (;; at = (at + 1) & mask) {
            int32_t row = slots[at];
            if (row == EMPTY_SLOT) break;
            if (row >= 0) {
                if (row >= rows.num_rows) {
                    error = "probe: a slot names a row past the end";
                    goto searched;
                }
                if (row_matches(&rows, row, ids[i], space)) {
                    found = row;
                    break;
                }
            }
            if (++looked == num_slots) {
                error = "probe: the slot array has no empty slot";
                goto searched;
            }
        }
        rows_out[i] = found;
        positions_out[i] = (int64_t)at;
        if (payloads_out != NULL) {
            int32_t payload = EMPTY_SLOT;
            if (found >= 0)
                memcpy(&payload, rows.records + found * stride + payload_offset, 4);
            payloads_out[i] = payload;
        }
    }
searched:
    Py_END_ALLOW_THREADS
#undef HOME_OF
    if (error != NULL) {
        PyErr_SetString(PyExc_ValueError, error);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release_buffer(&slots_view);
    release_buffer(&records_view);
    release_buffer(&ids_view);
    release_buffer(&rows_view);
    release_buffer(&positions_view);
    if (have_spaces) release(&spaces_view);
    if (have_payloads) release(&payloads_view);
    return result;
}

static const char place_doc[] =
    "place(slots, ids, spaces, rows, gamma, space_stride) -> deleted slots reused\n"
    "Put each (absent) id's row in the first free slot of its probe sequence, in order.";

static PyObject *place(PyObject *self, PyObject *args) {
    Py_buffer slots_view, ids_view, spaces_view, rows_view;
    PyObject *spaces_object;
    long long gamma, space_stride;
    if (!PyArg_ParseTuple(args, "O&O&OO&LL", writable, &slots_view, readable, &ids_view,
                          &spaces_object, readable, &rows_view, &gamma, &space_stride))
        return NULL;
    PyObject *result = NULL;
    int have_spaces = optional_buffer(spaces_object, &spaces_view, PyBUF_SIMPLE) == 0;
    if (!have_spaces) goto done;
    Py_ssize_t num_ids = ids_view.len / 8, num_slots = slots_view.len / 4;
    int shift = slot_shift(num_slots);
    if (shift < 0) goto done;
    if (rows_view.len / 8 != num_ids ||
        (spaces_view.buf != NULL && (!valid_itemsize(spaces_view.itemsize) ||
                                     spaces_view.len / spaces_view.itemsize != num_ids))) {
        PyErr_SetString(PyExc_ValueError, "place: arrays of mismatched sizes");
        goto done;
    }
    int32_t *slots = slots_view.buf;
    const int64_t *ids = ids_view.buf, *rows = rows_view.buf;
    for (Py_ssize_t i = 0; i < num_ids; i++) {
        if (rows[i] < 0 || rows[i] > INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "place: a row number outside int32");
            goto done;
        }
    }
    uint64_t mask = (uint64_t)num_slots - 1;
    long long reused = 0;
    const char *error = NULL; /* set without the GIL, raised with it */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < num_ids; i++) {
        if (i + IDS_AHEAD < num_ids) {
            Py_ssize_t ahead = i + IDS_AHEAD;
            int64_t ahead_space =
                spaces_view.buf ? read_int(spaces_view.buf, ahead, spaces_view.itemsize) : 0;
            __builtin_prefetch(slots + home_slot(ids[ahead], ahead_space, (uint64_t)gamma,
                                                 (uint64_t)space_stride, shift), 1);
        }
        int64_t space = spaces_view.buf ? read_int(spaces_view.buf, i, spaces_view.itemsize) : 0;
        uint64_t at = home_slot(ids[i], space, (uint64_t)gamma, (uint64_t)space_stride, shift);
        Py_ssize_t looked = 0;
        while (slots[at] >= 0) {
            at = (at + 1) & mask;
            if (++looked == num_slots) {
                error = "place: the slot array is full";
                goto placed;
            }
        }
        reused += slots[at] != EMPTY_SLOT;
        slots[at] = (int32_t)rows[i];
    }
placed:
    Py_END_ALLOW_THREADS
    if (error != NULL) {
        PyErr_SetString(PyExc_ValueError, error);
        goto done;
    }
    result = PyLong_FromLongLong(reused);
done:
    release_buffer(&slots_view);
    release_buffer(&ids_view);
    release_buffer(&rows_view);
    if (have_spaces) release(&spaces_view);
    return result;
}

static const char rehash_doc[] =
    "rehash(old_slots, records, stride, space_offset, space_size, slots, gamma, space_stride)\n"
    "    -> entries placed\n"
    "Put every live row of old_slots (each row's id, and space if keyed, read from its record)\n"
    "in the empty array slots, at the first free slot of its probe sequence, in old slot order.";

/* An id map's rebuild in one pass: no list of live rows, no gather of their ids, no sort.
 * Taken in the order of the old array, which is nearly that of the new home slots (a home
 * slot in an array twice as long is twice the old one, or one more), the writes run forward
 * through the new array. */
static PyObject *rehash(PyObject *self, PyObject *args) {
    Py_buffer old_view, records_view, slots_view;
    Py_ssize_t stride, space_offset, space_size;
    long long gamma, space_stride;
    if (!PyArg_ParseTuple(args, "O&O&nnnO&LL", readable, &old_view, readable, &records_view,
                          &stride, &space_offset, &space_size, writable, &slots_view, &gamma,
                          &space_stride))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t num_old = old_view.len / 4, num_slots = slots_view.len / 4;
    int shift = slot_shift(num_slots);
    if (shift < 0) goto done;
    int keyed = space_offset >= 0;
    if (stride < 8 || (keyed && (!valid_itemsize(space_size) ||
                                 space_offset + space_size > stride))) {
        PyErr_SetString(PyExc_ValueError, "rehash: records of a mismatched layout");
        goto done;
    }
    Rows rows = {records_view.buf, records_view.len / stride, stride, space_offset, space_size,
                 -1};
    const int32_t *old = old_view.buf;
    int32_t *slots = slots_view.buf;
    uint64_t mask = (uint64_t)num_slots - 1;
    long long placed = 0;
    const char *error = NULL; /* set without the GIL, raised with it */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < num_old; i++) {
        /* The old slots are read in order; the records they name lie anywhere: ask early. */
        if (i + IDS_AHEAD < num_old) {
            int32_t ahead = old[i + IDS_AHEAD];
            if (ahead >= 0 && ahead < rows.num_rows)
                __builtin_prefetch(rows.records + (Py_ssize_t)ahead * stride);
        }
        int32_t row = old[i];
        if (row < 0) continue; /* empty or deleted */
        if (row >= rows.num_rows) {
            error = "rehash: a slot names a row past the end";
            break;
        }
        const char *record = rows.records + (Py_ssize_t)row * stride;
        int64_t id;
        memcpy(&id, record, 8);
        int64_t space = keyed ? read_int(record + space_offset, 0, space_size) : 0;
        uint64_t at = home_slot(id, space, (uint64_t)gamma, (uint64_t)space_stride, shift);
        Py_ssize_t looked = 0;
        while (slots[at] != EMPTY_SLOT) {
            at = (at + 1) & mask;
            if (++looked == num_slots) {
                error = "rehash: the slot array is full";
                goto rehashed;
            }
        }
        slots[at] = row;
        placed++;
    }
rehashed:
    Py_END_ALLOW_THREADS
    if (error != NULL) {
        PyErr_SetString(PyExc_ValueError, error);
        goto done;
    }
    result = PyLong_FromLongLong(placed);
done:
    release_buffer(&old_view);
    release_buffer(&records_view);
    release_buffer(&slots_view);
    return result;
}

#define PLAIN_MULTIPLY_ADD(a, b, c) ((a) * (b) + (c))

/* Rows ahead whose memory is asked for before it is needed: a step's rows lie scattered over
 * tables far larger than the caches, so each row is a wait on memory unless fetched early. */
#define ROWS_AHEAD 8

static inline void prefetch_row(const float *base, int64_t row, Py_ssize_t dim) {
    const char *at = (const char *)(base + row * dim);
    for (Py_ssize_t offset = 0; offset < dim * 4; offset += 64) __builtin_prefetch(at + offset, 1);
}

typedef struct {
    float *weight, *sums; /* sums: NULL for SGD */
    const float *grads;
    const int64_t *rows;
    Py_ssize_t num_rows, dim;
    float clr, epsilon, decay;
    int decayed;
} StepRows;

/* torch's Adagrad on one row (`dim` values of param, sum and grad; clr, epsilon, decay and
 * decayed in scope): the one copy of its math, which a server's rows (step_rows) and a
 * trainer's own update of them (own_rows) both run, so the two agree bitwise. */
#define ADAGRAD_ROW(param, sum, grad, FUSE)                                                  \
    for (Py_ssize_t d = 0; d < dim; d++) {                                                   \
        float g = (grad)[d];                                                                 \
        if (decayed) g = FUSE((param)[d], decay, g);                                         \
        float s = FUSE(g, g, (sum)[d]);                                                      \
        (sum)[d] = s;                                                                        \
        (param)[d] = (param)[d] - clr * g / (sqrtf(s) + epsilon);                            \
    }

/* torch.optim's SGD without momentum on one row (`dim` values of param and grad; clr, decay
 * and decayed in scope): param + (-lr) * (grad + decay * param), each multiply-add by FUSE.
 * Its one copy, as ADAGRAD_ROW's (`sum` unused). */
#define SGD_ROW(param, sum, grad, FUSE)                                                      \
    for (Py_ssize_t d = 0; d < dim; d++) {                                                   \
        float g = (grad)[d];                                                                 \
        if (decayed) g = FUSE((param)[d], decay, g);                                         \
        (param)[d] = FUSE(g, -clr, (param)[d]);                                              \
    }

/* STEP_ROW(param, sum, grad, FUSE) on every row of `a` in place. FUSE(x, y, z) is x * y + z:
 * rounded once where torch's loop fuses it (its vectorised kernels are compiled for the CPU's
 * multiply-add), else twice. */
#define EACH_ROW(a, STEP_ROW, FUSE)                                                          \
    /* Locals, not the struct's fields: a store to a row may not alias them. */               \
    const Py_ssize_t dim = (a)->dim, num_rows = (a)->num_rows;                               \
    const float clr = (a)->clr, epsilon = (a)->epsilon, decay = (a)->decay;                  \
    const int decayed = (a)->decayed;                                                        \
    float *weight = (a)->weight, *sums = (a)->sums;                                          \
    const float *grads = (a)->grads;                                                         \
    const int64_t *rows = (a)->rows;                                                         \
    (void)epsilon;                                                                           \
    for (Py_ssize_t i = 0; i < num_rows; i++) {                                              \
        float *param = weight + rows[i] * dim;                                               \
        float *sum = sums != NULL ? sums + rows[i] * dim : NULL;                             \
        const float *grad = grads + i * dim;                                                 \
        (void)sum;                                                                           \
        if (i + ROWS_AHEAD < num_rows) {                                                     \
            prefetch_row(weight, rows[i + ROWS_AHEAD], dim);                                 \
            if (sums != NULL) prefetch_row(sums, rows[i + ROWS_AHEAD], dim);                 \
        }                                                                                    \
        STEP_ROW(param, sum, grad, FUSE)                                                     \
    }

enum { RULE_SGD = 0, RULE_ADAGRAD = 1, RULE_ROWWISE = 2 }; /* as native.RULE_KINDS */

static void step_unfused(int kind, const StepRows *a) {
    if (kind == RULE_ADAGRAD) {
        EACH_ROW(a, ADAGRAD_ROW, PLAIN_MULTIPLY_ADD)
    } else {
        EACH_ROW(a, SGD_ROW, PLAIN_MULTIPLY_ADD)
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_FMA_TARGET 1
__attribute__((target("avx2,fma"))) static void step_fused_hw(int kind, const StepRows *a) {
    if (kind == RULE_ADAGRAD) {
        EACH_ROW(a, ADAGRAD_ROW, fmaf)
    } else {
        EACH_ROW(a, SGD_ROW, fmaf)
    }
}
#endif

static void step_fused(int kind, const StepRows *a) {
#ifdef HAVE_FMA_TARGET
    if (__builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2")) {
        step_fused_hw(kind, a);
        return;
    }
#endif
    /* libm's exact fmaf: slower, the same result */
    if (kind == RULE_ADAGRAD) {
        EACH_ROW(a, ADAGRAD_ROW, fmaf)
    } else {
        EACH_ROW(a, SGD_ROW, fmaf)
    }
}

static const char step_rows_doc[] =
    "step_rows(kind, weight, sums, dim, rows, grads, lr, eps, weight_decay, fused)\n"
    "torch.optim's update (kind 0: SGD without momentum; 1: fused Adagrad, float32, no lr\n"
    "decay) of weight[rows] (and sums[rows]: None for SGD) in place, with grads' rows in order;\n"
    "`fused`: whether multiply-adds are rounded once, as torch's kernel on this CPU does.";

static PyObject *step_rows(PyObject *self, PyObject *args) {
    Py_buffer weight_view, sums_view = {0}, rows_view, grads_view;
    PyObject *sums;
    Py_ssize_t dim;
    double lr, eps, weight_decay;
    int kind, fused;
    if (!PyArg_ParseTuple(args, "iO&OnO&O&dddp", &kind, writable, &weight_view, &sums, &dim,
                          readable, &rows_view, readable, &grads_view, &lr, &eps, &weight_decay,
                          &fused))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t num_rows = rows_view.len / 8, table_rows = dim > 0 ? weight_view.len / 4 / dim : 0;
    if (optional_buffer(sums, &sums_view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (kind != RULE_SGD && kind != RULE_ADAGRAD) {
        PyErr_SetString(PyExc_ValueError, "step_rows: no such rule");
        goto done;
    }
    if (dim <= 0 || (kind == RULE_ADAGRAD) != (sums_view.buf != NULL) ||
        (sums_view.buf != NULL && sums_view.len != weight_view.len) ||
        grads_view.len != num_rows * dim * 4) {
        PyErr_SetString(PyExc_ValueError, "step_rows: arrays of mismatched sizes");
        goto done;
    }
    const int64_t *rows = rows_view.buf;
    for (Py_ssize_t i = 0; i < num_rows; i++) {
        if (rows[i] < 0 || rows[i] >= table_rows) {
            PyErr_SetString(PyExc_ValueError, "step_rows: a row past the table's end");
            goto done;
        }
    }
    StepRows update = {weight_view.buf, sums_view.buf, grads_view.buf, rows, num_rows, dim,
                       (float)lr, (float)eps, (float)weight_decay, weight_decay != 0.0};
    Py_BEGIN_ALLOW_THREADS
    if (fused) step_fused(kind, &update);
    else step_unfused(kind, &update);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    release_buffer(&weight_view);
    release(&sums_view);
    release_buffer(&rows_view);
    release_buffer(&grads_view);
    return result;
}

/* own_rows: a trainer's own update of the rows it pulled (paramserver/trainer/ownupdates.py),
 * every table in one call. Each table brings its pulled rows (values, ids sorted), the places
 * `at` of those that came with state, its step's gradients (grad_ids sorted unique) and the
 * state aligned with `at`; a row whose id has no gradient takes no update. The rules' math is
 * the servers' (ADAGRAD_ROW; torch.optim's SGD; RowWiseAdagrad's, with the means of the
 * squared gradients from torch), so the rows end bitwise as the servers will make them. */
typedef struct {
    float *values, *state;            /* state: NULL (sgd), else a row (adagrad) or one value */
    const float *grads, *means;       /* means: one per gradient row (rowwise), else NULL */
    const int64_t *ids, *at, *grad_ids;
    Py_ssize_t num_values, num_at, num_grads, dim;
    float lr;
} OwnTable;

typedef struct {
    int kind, decayed;
    float epsilon, decay;
} OwnRule;

/* Where `id` is among `grad_ids` (sorted, `count` of them), -1 if not there. A table's rows
 * come in ascending id order, so the search gallops on from `*from`, where the last one's
 * ended (which it moves on): all of a table's rows cost about one pass over its gradients'
 * ids, not a binary search each. An id below the last one's searches from the start. */
static inline Py_ssize_t grad_place(const int64_t *grad_ids, Py_ssize_t count, int64_t id,
                                    Py_ssize_t *from) {
    Py_ssize_t low = *from, high = low, step = 1;
    if (low > 0 && grad_ids[low - 1] >= id) low = high = 0;
    while (high < count && grad_ids[high] < id) {
        low = high + 1;
        high += step;
        step *= 2;
    }
    if (high > count) high = count;
    while (low < high) { /* the first at or past id, in [low, high] */
        Py_ssize_t mid = low + (high - low) / 2;
        if (grad_ids[mid] < id) low = mid + 1;
        else high = mid;
    }
    *from = low;
    return low < count && grad_ids[low] == id ? low : -1;
}

/* Which of a table's rows take a gradient: (row's place in `at`, gradient's place) pairs, in
 * the rows' order; returns how many. Rows in ascending id order (the usual case) are matched
 * by one merge of the two sorted lists with no branch a row (about half the rows match,
 * unpredictably), over the rows' ids gathered first (so that no step waits on two loads);
 * others by grad_place. `pairs` holds 3 * num_at entries: the pairs, then the ids. */
static Py_ssize_t matched_rows(const OwnTable *t, Py_ssize_t *pairs) {
    const int64_t *at = t->at, *grad_ids = t->grad_ids;
    Py_ssize_t n = t->num_at, m = t->num_grads, k = 0, i = 0, j = 0;
    int64_t *ids = (int64_t *)(pairs + 2 * n);
    if (at == NULL) ids = (int64_t *)t->ids; /* every row, in order */
    else
        for (Py_ssize_t r = 0; r < n; r++) ids[r] = t->ids[at[r]];
    int ascending = 1;
    for (Py_ssize_t r = 1; r < n; r++) ascending &= ids[r] > ids[r - 1];
    if (!ascending) {
        for (; i < n; i++) {
            Py_ssize_t place = grad_place(grad_ids, m, ids[i], &j);
            pairs[2 * k] = i;
            pairs[2 * k + 1] = place;
            k += place >= 0;
        }
        return k;
    }
    while (i < n && j < m) { /* each step moves past the lesser id (both where they match) */
        int64_t id = ids[i], grad_id = grad_ids[j];
        pairs[2 * k] = i; /* kept where they match, written over where not */
        pairs[2 * k + 1] = j;
        k += id == grad_id;
        i += id <= grad_id;
        j += grad_id <= id;
    }
    return k;
}

#define OWN_TABLE(t, r, FUSE, pairs)                                                         \
    const Py_ssize_t dim = (t)->dim;                                                         \
    const float clr = (t)->lr, epsilon = (r)->epsilon, decay = (r)->decay;                   \
    const int decayed = (r)->decayed, kind = (r)->kind;                                      \
    Py_ssize_t updated = matched_rows(t, pairs);                                             \
    for (Py_ssize_t q = 0; q < updated; q++) {                                               \
        Py_ssize_t i = (pairs)[2 * q], j = (pairs)[2 * q + 1];                               \
        float *param = (t)->values + ((t)->at != NULL ? (t)->at[i] : i) * dim;              \
        const float *grad = (t)->grads + j * dim;                                            \
        if (kind == RULE_ADAGRAD) {                                                          \
            float *sum = (t)->state + i * dim;                                               \
            ADAGRAD_ROW(param, sum, grad, FUSE)                                              \
        } else if (kind == RULE_ROWWISE) {                                                   \
            float accumulated = (t)->state[i] + (t)->means[j];                               \
            (t)->state[i] = accumulated;                                                     \
            float denominator = sqrtf(accumulated) + epsilon;                                \
            for (Py_ssize_t d = 0; d < dim; d++)                                             \
                param[d] = param[d] + -clr * grad[d] / denominator;                          \
        } else {                                                                             \
            SGD_ROW(param, NULL, grad, FUSE)                                                 \
        }                                                                                    \
    }                                                                                        \
    return updated;

static Py_ssize_t own_unfused(const OwnTable *t, const OwnRule *r, Py_ssize_t *pairs) {
    OWN_TABLE(t, r, PLAIN_MULTIPLY_ADD, pairs)
}

#ifdef HAVE_FMA_TARGET
__attribute__((target("avx2,fma"))) static Py_ssize_t own_fused_hw(const OwnTable *t,
                                                                   const OwnRule *r,
                                                                   Py_ssize_t *pairs) {
    OWN_TABLE(t, r, fmaf, pairs)
}
#endif

static Py_ssize_t own_fused(const OwnTable *t, const OwnRule *r, Py_ssize_t *pairs) {
#ifdef HAVE_FMA_TARGET
    if (__builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2"))
        return own_fused_hw(t, r, pairs);
#endif
    OWN_TABLE(t, r, fmaf, pairs)
}

/* One table's tuple exported into `views` (5 of them) and `t`, its rows that take the update
 * `at[begin:end]` with their state from row `begin` of `state` (NULL: SGD's none), checked;
 * -1 with an error set (what was exported stays in views, for the caller to release). */
static int export_own_table(PyObject *item, int kind, Py_buffer *views, const int64_t *at,
                            float *state, Py_ssize_t begin, Py_ssize_t end, OwnTable *t) {
    PyObject *means;
    Py_ssize_t dim;
    double lr;
    if (!PyTuple_Check(item)) {
        PyErr_SetString(PyExc_TypeError, "own_rows: a table is a tuple");
        return -1;
    }
    if (!PyArg_ParseTuple(item, "O&nO&O&O&Od", writable, &views[0], &dim, readable, &views[1],
                          readable, &views[2], readable, &views[3], &means, &lr))
        return -1;
    if (optional_buffer(means, &views[4], PyBUF_C_CONTIGUOUS) < 0) return -1;
    Py_ssize_t state_width = kind == RULE_ADAGRAD ? dim : 1;
    *t = (OwnTable){views[0].buf, state == NULL ? NULL : state + begin * state_width,
                    views[3].buf, views[4].buf, views[1].buf, at == NULL ? NULL : at + begin,
                    views[2].buf, 0, end - begin, views[2].len / 8, dim, (float)lr};
    if (dim <= 0 || dim > PY_SSIZE_T_MAX / 8 || views[0].len % (4 * dim)) goto mismatched;
    t->num_values = views[0].len / 4 / dim;
    if (at == NULL) t->num_at = t->num_values; /* every row, in order */
    if (views[1].len != t->num_values * 8 || views[2].len % 8 ||
        views[3].len != t->num_grads * dim * 4 || (kind == RULE_ROWWISE) != (t->means != NULL) ||
        (t->means != NULL && views[4].len != t->num_grads * 4))
        goto mismatched;
    for (Py_ssize_t i = 0; t->at != NULL && i < t->num_at; i++) {
        if (t->at[i] < 0 || t->at[i] >= t->num_values) {
            PyErr_SetString(PyExc_ValueError, "own_rows: a place past the pulled rows");
            return -1;
        }
    }
    return 0;
mismatched:
    PyErr_SetString(PyExc_ValueError, "own_rows: arrays of mismatched sizes");
    return -1;
}

static const char own_rows_doc[] =
    "own_rows(kind, tables, at, state, spans, eps, weight_decay, fused) -> rows updated\n"
    "A trainer's own update (kind 0: SGD, 1: Adagrad, 2: row-wise Adagrad) of the rows it\n"
    "pulled, each table j (values, dim, ids, grad_ids, grads, means, lr) in place: the rows\n"
    "at[b:e] of values (float32 rows of dim; ids their sorted ids), where (b, e) = spans[j]\n"
    "(at and spans None: every row of values, in order; SGD's, which reads no state),\n"
    "and the same rows of state take the gradient of the same id among grad_ids (sorted\n"
    "unique; grads its rows), if any. at: int64 places; state: None (SGD), a float32 row\n"
    "(Adagrad) or value (row-wise) per place; spans: int64 pairs, one per table, within at;\n"
    "means: row-wise's mean squared gradient per gradient row, else None. `fused`:\n"
    "multiply-adds rounded once, as torch's on this CPU.";

static PyObject *own_rows(PyObject *self, PyObject *args) {
    PyObject *tables_arg, *at_arg, *state_arg, *spans_arg, *result = NULL;
    Py_buffer at = {0}, state = {0}, spans = {0};
    OwnRule rule;
    double eps, weight_decay;
    int fused;
    if (!PyArg_ParseTuple(args, "iOOOOddp", &rule.kind, &tables_arg, &at_arg, &state_arg,
                          &spans_arg, &eps, &weight_decay, &fused))
        return NULL;
    PyObject *tables = NULL;
    Py_buffer *views = NULL;
    OwnTable *each = NULL;
    Py_ssize_t *pairs = NULL;
    Py_ssize_t num_tables = 0, updated = 0;
    if (rule.kind < RULE_SGD || rule.kind > RULE_ROWWISE) {
        PyErr_SetString(PyExc_ValueError, "own_rows: no such rule");
        goto done;
    }
    rule = (OwnRule){rule.kind, weight_decay != 0.0, (float)eps, (float)weight_decay};
    if (optional_buffer(state_arg, &state, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0 ||
        optional_buffer(at_arg, &at, PyBUF_C_CONTIGUOUS) < 0 ||
        optional_buffer(spans_arg, &spans, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    tables = PySequence_Fast(tables_arg, "own_rows: tables must be a sequence");
    if (tables == NULL) goto done;
    num_tables = PySequence_Fast_GET_SIZE(tables);
    const int64_t *bounds = spans.buf;
    Py_ssize_t num_at = at.len / 8;
    int every_row = at.buf == NULL; /* every pulled row of each table, in order: SGD's */
    if (every_row != (spans.buf == NULL) || (every_row && state.buf != NULL) || at.len % 8 ||
        (!every_row && spans.len != num_tables * 16) ||
        (rule.kind == RULE_SGD) != (state.buf == NULL)) {
        PyErr_SetString(PyExc_ValueError, "own_rows: arrays of mismatched sizes");
        goto done;
    }
    for (Py_ssize_t j = 0; !every_row && j < num_tables; j++) {
        if (bounds[2 * j] < 0 || bounds[2 * j] > bounds[2 * j + 1] || bounds[2 * j + 1] > num_at) {
            PyErr_SetString(PyExc_ValueError, "own_rows: a span past the places");
            goto done;
        }
    }
    views = PyMem_Calloc(5 * (num_tables ? num_tables : 1), sizeof(Py_buffer));
    each = PyMem_Calloc(num_tables ? num_tables : 1, sizeof(OwnTable));
    if (views == NULL || each == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t most = num_at;
    for (Py_ssize_t j = 0; j < num_tables; j++) {
        Py_ssize_t begin = every_row ? 0 : bounds[2 * j], end = every_row ? 0 : bounds[2 * j + 1];
        if (export_own_table(PySequence_Fast_GET_ITEM(tables, j), rule.kind, views + 5 * j,
                             at.buf, state.buf, begin, end, &each[j]) < 0)
            goto done;
        if (each[j].num_at > most) most = each[j].num_at;
        Py_ssize_t width = rule.kind == RULE_ADAGRAD ? each[j].dim : 1;
        if (state.buf != NULL && state.len != num_at * width * 4) {
            PyErr_SetString(PyExc_ValueError, "own_rows: arrays of mismatched sizes");
            goto done;
        }
    }
    pairs = PyMem_Malloc(3 * (most ? most : 1) * sizeof(Py_ssize_t)); /* any table's */
    if (pairs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < num_tables; j++)
        updated += fused ? own_fused(&each[j], &rule, pairs) : own_unfused(&each[j], &rule, pairs);
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(updated);
done:
    for (Py_ssize_t v = 0; views != NULL && v < 5 * num_tables; v++) release(&views[v]);
    PyMem_Free(views);
    PyMem_Free(each);
    PyMem_Free(pairs);
    Py_XDECREF(tables);
    release(&at);
    release(&state);
    release(&spans);
    return result;
}

static inline uint64_t mix64(uint64_t x) { /* SplitMix64's finalizer, as hashing.mix64 */
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static const char init_rows_doc[] =
    "init_rows(weight, dim, rows, ids, salts, scales, multipliers, states, initial)\n"
    "New rows of a dynamic table's arena (float32), as dynamic_rows._uniform_rows makes\n"
    "them: weight[rows[i]] from ids[i], salts[i] and scales[i]; each array of `states` (one\n"
    "value or `dim` per row) set to `initial` at those rows.";

static PyObject *init_rows(PyObject *self, PyObject *args) {
    Py_buffer weight_view, rows_view, ids_view, salts_view, scales_view, multipliers_view;
    Py_ssize_t dim;
    PyObject *states;
    double initial;
    if (!PyArg_ParseTuple(args, "O&nO&O&O&O&O&O!d", writable, &weight_view, &dim, readable,
                          &rows_view, readable, &ids_view, readable, &salts_view, readable,
                          &scales_view, readable, &multipliers_view, &PyTuple_Type, &states,
                          &initial))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t num_states = PyTuple_GET_SIZE(states), acquired = 0;
    Py_buffer state_views[8];
    Py_ssize_t count = rows_view.len / 8;
    Py_ssize_t table_rows = dim > 0 ? weight_view.len / 4 / dim : 0;
    if (dim <= 0 || num_states > 8 || ids_view.len != count * 8 || salts_view.len != count * 8 ||
        scales_view.len != count * 4 || multipliers_view.len != dim * 8) {
        PyErr_SetString(PyExc_ValueError, "init_rows: arrays of mismatched sizes");
        goto done;
    }
    for (; acquired < num_states; acquired++) {
        Py_buffer *view = &state_views[acquired];
        if (get_buffer(PyTuple_GET_ITEM(states, acquired), view, PyBUF_WRITABLE) < 0)
            goto done;
        Py_ssize_t width = view->len / 4 / (table_rows ? table_rows : 1);
        if ((width != 1 && width != dim) || view->len != table_rows * width * 4) {
            acquired++;
            PyErr_SetString(PyExc_ValueError, "init_rows: a state array of another shape");
            goto done;
        }
    }
    const int64_t *rows = rows_view.buf, *ids = ids_view.buf, *salts = salts_view.buf;
    const float *scales = scales_view.buf;
    const uint64_t *multipliers = multipliers_view.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (rows[i] < 0 || rows[i] >= table_rows) {
            PyErr_SetString(PyExc_ValueError, "init_rows: a row past the arena's end");
            goto done;
        }
    }
    float *weight = weight_view.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t seed = mix64((uint64_t)ids[i] + (uint64_t)salts[i]);
        const float scale = scales[i], factor = 2.0f * scale * (1.0f / 16777216.0f);
        float *row = weight + rows[i] * dim;
        for (Py_ssize_t j = 0; j < dim; j++) {
            float unit = (float)((seed * multipliers[j]) >> 40); /* exact: under 2^24 */
            row[j] = unit * factor - scale;
        }
        for (Py_ssize_t k = 0; k < num_states; k++) {
            Py_ssize_t width = state_views[k].len / 4 / table_rows;
            float *state = (float *)state_views[k].buf + rows[i] * width;
            for (Py_ssize_t j = 0; j < width; j++) state[j] = (float)initial;
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t k = 0; k < acquired; k++) release_buffer(&state_views[k]);
    release_buffer(&weight_view);
    release_buffer(&rows_view);
    release_buffer(&ids_view);
    release_buffer(&salts_view);
    release_buffer(&scales_view);
    release_buffer(&multipliers_view);
    return result;
}

typedef struct {
    uint64_t key; /* the id with its sign bit flipped: unsigned order is the ids' order */
    Py_ssize_t at;
} KeyAt;

#define SIGN_BIT 0x8000000000000000ULL

/* Sorts `items` by key (stable), least significant byte first, skipping the bytes every key
 * shares; `scratch` holds as many. Returns the array that holds the sorted items. */
static KeyAt *radix_sort(KeyAt *items, KeyAt *scratch, Py_ssize_t count) {
    Py_ssize_t starts[8][256];
    memset(starts, 0, sizeof(starts));
    for (Py_ssize_t i = 0; i < count; i++)
        for (int byte = 0; byte < 8; byte++) starts[byte][(items[i].key >> (8 * byte)) & 255]++;
    for (int byte = 0; byte < 8; byte++) {
        int shift = 8 * byte;
        Py_ssize_t *start = starts[byte];
        if (start[(items[0].key >> shift) & 255] == count) continue;
        Py_ssize_t total = 0;
        for (int digit = 0; digit < 256; digit++) {
            Py_ssize_t size = start[digit];
            start[digit] = total;
            total += size;
        }
        for (Py_ssize_t i = 0; i < count; i++) scratch[start[(items[i].key >> shift) & 255]++] = items[i];
        KeyAt *sorted = scratch;
        scratch = items;
        items = sorted;
    }
    return items;
}

/* One segment's sorted unique ids into `unique` and each id's index among them into `inverse`;
 * returns how many are unique. */
static Py_ssize_t unique_segment(const int64_t *ids, Py_ssize_t count, KeyAt *items,
                                 int64_t *unique, int64_t *inverse) {
    if (count == 0) return 0;
    int64_t low = ids[0], high = ids[0];
    for (Py_ssize_t i = 1; i < count; i++) {
        low = ids[i] < low ? ids[i] : low;
        high = ids[i] > high ? ids[i] : high;
    }
    /* Ids within a span of under 8 per id (a small table's, or a batch dense in its table):
     * a mark per id in the span, ranked in one pass over it, costs less than a sort. The
     * marks fit in `items` (2 * count of them, 16 bytes each). */
    uint64_t span = (uint64_t)high - (uint64_t)low;
    if (span < 8 * (uint64_t)count) {
        int32_t *rank = (int32_t *)items;
        memset(rank, 0, (span + 1) * sizeof *rank);
        for (Py_ssize_t i = 0; i < count; i++) rank[(uint64_t)ids[i] - (uint64_t)low] = 1;
        /* Without a branch per mark (about half of them are set, unpredictably): each is
         * written out as the next unique id, which only a set one keeps. The last id is set,
         * so nothing is written past the unique ids. */
        int32_t num_unique = 0;
        for (uint64_t v = 0; v < span; v++) {
            int32_t set = rank[v];
            unique[num_unique] = (int64_t)((uint64_t)low + v);
            rank[v] = num_unique;
            num_unique += set;
        }
        unique[num_unique] = high;
        rank[span] = num_unique++;
        for (Py_ssize_t i = 0; i < count; i++)
            inverse[i] = rank[(uint64_t)ids[i] - (uint64_t)low];
        return num_unique;
    }
    for (Py_ssize_t i = 0; i < count; i++) items[i] = (KeyAt){(uint64_t)ids[i] ^ SIGN_BIT, i};
    const KeyAt *sorted = radix_sort(items, items + count, count);
    Py_ssize_t num_unique = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i == 0 || sorted[i].key != sorted[i - 1].key)
            unique[num_unique++] = (int64_t)(sorted[i].key ^ SIGN_BIT);
        inverse[sorted[i].at] = num_unique - 1;
    }
    return num_unique;
}

/* unique_segment for _tensors.cpp's unique_lookups, with a workspace of
 * unique_workspace_bytes(largest segment). */
Py_ssize_t unique_ids(const int64_t *ids, Py_ssize_t count, void *workspace, int64_t *unique,
                      int64_t *inverse) {
    return unique_segment(ids, count, workspace, unique, inverse);
}

size_t unique_workspace_bytes(Py_ssize_t largest) {
    return 2 * (size_t)(largest > 0 ? largest : 1) * sizeof(KeyAt);
}

/* gather_rows and scatter_rows: the lookups of a trainer's step, all tables in one call. */
typedef struct {
    Py_ssize_t table;
    Py_buffer positions; /* int64 */
    Py_buffer rows;      /* float32, one per position; buf NULL: no gradient (scatter_rows) */
    Py_ssize_t row_step; /* floats from one row of `rows` to the next */
} Lookup;

/* Export `tables` and the (table, positions, rows) triples of `lookups`, and check them all;
 * on failure release what was exported and return -1 with ValueError (or the export's error)
 * set. Tables are written by scatter, lookups' rows by gather. */
/* A move of rows between tables and lookups (gather_rows and scatter_rows, pool_bags and
 * scatter_bags): the argument sequences, every table's buffer and one record per lookup. */
typedef struct {
    PyObject *tables, *lookups;
    Py_ssize_t num_tables, num_lookups;
    Py_buffer *table_views;
    void *each; /* num_lookups records, zeroed */
} Moves;

/* Open a move with lookup records of `record` bytes; 0, or -1 with an exception set (its
 * parts are freed by close_moves either way). */
static int open_moves(PyObject *tables_arg, PyObject *lookups_arg, size_t record, Moves *m) {
    memset(m, 0, sizeof *m);
    if ((m->tables = PySequence_Fast(tables_arg, "tables must be a sequence")) == NULL ||
        (m->lookups = PySequence_Fast(lookups_arg, "lookups must be a sequence")) == NULL)
        return -1;
    m->num_tables = PySequence_Fast_GET_SIZE(m->tables);
    m->num_lookups = PySequence_Fast_GET_SIZE(m->lookups);
    m->table_views = PyMem_Calloc(m->num_tables ? m->num_tables : 1, sizeof(Py_buffer));
    m->each = PyMem_Calloc(m->num_lookups ? m->num_lookups : 1, record);
    if (m->table_views == NULL || m->each == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* Every table's buffer (writable where `writable`), each of whole rows of `row_bytes`; -1 with
 * an exception set, or 0 with *error the text of what is wrong (NULL: nothing). */
static int export_tables(Moves *m, Py_ssize_t row_bytes, int writable, const char **error) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    for (Py_ssize_t t = 0; t < m->num_tables; t++) {
        if (get_buffer(PySequence_Fast_GET_ITEM(m->tables, t), &m->table_views[t],
                               flags) < 0)
            return -1;
        if (m->table_views[t].len % row_bytes) *error = "a table's size is not whole rows";
    }
    return 0;
}

/* Release a move's tables and free its parts (the caller releases its lookups' buffers). */
static void close_moves(Moves *m) {
    for (Py_ssize_t t = 0; t < m->num_tables && m->table_views != NULL; t++)
        release(&m->table_views[t]);
    PyMem_Free(m->table_views);
    PyMem_Free(m->each);
    Py_XDECREF(m->tables);
    Py_XDECREF(m->lookups);
}

/* The layout of a lookup's `count` rows of `dim` floats in `view`: a flat buffer of them end to
 * end, or a 2-D one whose rows are contiguous and any distance apart (from a buffer asked with
 * PyBUF_STRIDES); sets *row_step, the floats from one row to the next. NULL, or what is wrong. */
static const char *row_layout(const Py_buffer *view, Py_ssize_t dim, Py_ssize_t count,
                              Py_ssize_t *row_step) {
    *row_step = dim;
    if (view->ndim <= 1 || view->strides == NULL) {
        if (view->itemsize != 4 || !PyBuffer_IsContiguous(view, 'C'))
            return "a lookup's rows are not rows of contiguous floats";
        if (view->len % (4 * dim) || view->len / (4 * dim) != count)
            return "a lookup's positions and rows differ in number";
        return NULL;
    }
    if (view->ndim != 2 || view->itemsize != 4 || view->shape[1] != dim ||
        (dim > 1 && view->strides[1] != 4) || view->strides[0] < 0 || view->strides[0] % 4)
        return "a lookup's rows are not rows of contiguous floats";
    if (view->shape[0] != count) return "a lookup's positions and rows differ in number";
    *row_step = view->strides[0] / 4;
    return NULL;
}

static int export_lookups(Moves *m, Py_ssize_t dim, int scatter) {
    const char *error = NULL;
    /* Gradients may be strided (a stack's backward hands out views): rows of contiguous
     * floats, any distance apart. Outputs are written whole, so contiguous. */
    int rows_flags = scatter ? PyBUF_STRIDES : PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE;
    Lookup *each = m->each;
    Py_buffer *table_views = m->table_views;
    Py_ssize_t num_tables = m->num_tables;
    if (export_tables(m, 4 * dim, scatter, &error) < 0) return -1;
    for (Py_ssize_t j = 0; j < m->num_lookups && error == NULL; j++) {
        PyObject *item = PySequence_Fast_GET_ITEM(m->lookups, j);
        PyObject *rows;
        if (!PyTuple_Check(item)) {
            PyErr_SetString(PyExc_TypeError, "a lookup is a (table, positions, rows) tuple");
            return -1;
        }
        if (!PyArg_ParseTuple(item, "nO&O", &each[j].table, buffer_converter,
                              &each[j].positions, &rows))
            return -1;
        if (!scatter && rows == Py_None) {
            error = "a lookup without rows";
            break;
        }
        if (optional_buffer(rows, &each[j].rows, rows_flags) < 0) return -1;
        Py_ssize_t count = each[j].positions.len / 8;
        if (each[j].positions.buf == NULL || each[j].positions.len % 8 ||
            (each[j].rows.buf != NULL &&
             (error = row_layout(&each[j].rows, dim, count, &each[j].row_step)) != NULL)) {
            if (error == NULL) error = "a lookup's positions and rows differ in number";
            break;
        }
        if (each[j].table < 0 || each[j].table >= num_tables) {
            error = "a lookup of no table";
            break;
        }
        Py_ssize_t table_rows = table_views[each[j].table].len / 4 / dim;
        const int64_t *positions = each[j].positions.buf;
        for (Py_ssize_t i = 0; i < count; i++) {
            if (positions[i] < 0 || positions[i] >= table_rows) {
                error = "a position past its table's end";
                break;
            }
        }
    }
    if (error != NULL) {
        PyErr_Format(PyExc_ValueError, "%s: %s", scatter ? "scatter_rows" : "gather_rows",
                     error);
        return -1;
    }
    return 0;
}

static PyObject *move_rows(PyObject *args, int scatter) {
    PyObject *tables_arg, *lookups_arg, *result = NULL;
    Py_ssize_t dim;
    if (!PyArg_ParseTuple(args, "OOn", &tables_arg, &lookups_arg, &dim)) return NULL;
    if (dim <= 0 || dim > PY_SSIZE_T_MAX / 8) {  /* sizes in bytes below never overflow */
        PyErr_SetString(PyExc_ValueError, "rows of width < 1, or too wide");
        return NULL;
    }
    Moves m;
    if (open_moves(tables_arg, lookups_arg, sizeof(Lookup), &m) < 0 ||
        export_lookups(&m, dim, scatter) < 0)
        goto done;
    Lookup *each = m.each;
    Py_buffer *table_views = m.table_views;
    Py_ssize_t num_lookups = m.num_lookups;
    size_t row_bytes = (size_t)dim * 4;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < num_lookups; j++) {
        const int64_t *positions = each[j].positions.buf;
        Py_ssize_t count = each[j].positions.len / 8;
        float *table = table_views[each[j].table].buf, *rows = each[j].rows.buf;
        Py_ssize_t row_step = each[j].row_step;
        if (rows == NULL) continue;
        for (Py_ssize_t i = 0; i < count; i++) {
            float *row = table + positions[i] * dim, *own = rows + i * row_step;
            if (!scatter) {
                memcpy(own, row, row_bytes);
                continue;
            }
            for (Py_ssize_t k = 0; k < dim; k++) row[k] += own[k];
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t j = 0; j < m.num_lookups && m.each != NULL; j++) {
        release(&((Lookup *)m.each)[j].positions);
        release(&((Lookup *)m.each)[j].rows);
    }
    close_moves(&m);
    return result;
}

static const char gather_rows_doc[] =
    "gather_rows(tables, lookups, dim)\n"
    "Each lookup (table, positions, out) of `lookups` copies rows `positions` (int64) of\n"
    "tables[table] into out, in order: every table and out float32 rows `dim` wide.";

static PyObject *gather_rows(PyObject *self, PyObject *args) { return move_rows(args, 0); }

static const char scatter_rows_doc[] =
    "scatter_rows(tables, lookups, dim)\n"
    "Each lookup (table, positions, grads) of `lookups` adds grads[i] to row positions[i] of\n"
    "tables[table] in place, lookup by lookup and row by row (index_add_'s order); a lookup's\n"
    "grads None adds nothing. Every table and grads float32 rows `dim` wide; a grads' rows\n"
    "may lie apart (a 2-D strided buffer whose rows are each contiguous).";

static PyObject *scatter_rows(PyObject *self, PyObject *args) { return move_rows(args, 1); }

/* pool_bags and scatter_bags: a trainer's pooled lookups (EmbeddingBag's sum and mean, with
 * per-sample weights and a padding row) in the rows pulled for each table, and their gradients
 * added back: each bag's rows summed in the bag's order from zero (torch's order: fbgemm's
 * kernel's, which fuses a weight's product into the sum, for float32 without padding; torch's
 * own loop's, which rounds the product first, else), a mean divided by the bag's rows that are not
 * padding. Backward adds each id's share of its bag's gradient (its weight, or 1 / the bag's size
 * for a mean, rounded to the rows' type) into its row in one of two ways. In order (a layer with
 * sparse=True): id by id as given, each share's product rounded before it is added, which is
 * torch's sparse gradient made dense. Else as torch's dense backward: each share a multiply-add
 * as torch's axpy makes it, visiting the ids in the order of torch.sort(ids): below
 * TORCH_RADIX_SORT_FROM ids, std::sort's (torch_sort_order); from there on, torch's sort is
 * stable, and the ids' own order adds each row's terms in the same order as a stable sort
 * (only the order within a row matters: rows are added to independently). Rows float32 or
 * float64 (`wide`). */
typedef struct {
    Py_ssize_t table;
    Py_buffer positions; /* int64: each id's row in its table */
    Py_buffer starts;    /* int64: where each bag starts, and the end (bags + 1) */
    Py_buffer weights;   /* one per id, of the rows' type; buf NULL: none */
    Py_ssize_t padding;  /* the padding row's position, -1: none */
    int mean;
    int in_order;        /* backward: the ids' own order, products rounded (sparse=True) */
    Py_buffer pooled;    /* bags x dim: out (pool_bags), gradients (scatter_bags; NULL: none) */
} Bags;

/* Check one Bags against its table (`table_rows` rows), ids and bags; NULL if sound. */
static const char *check_bags(const Bags *b, Py_ssize_t table_rows, Py_ssize_t dim,
                              Py_ssize_t item) {
    Py_ssize_t count = b->positions.len / 8, num_bags = b->starts.len / 8 - 1;
    const int64_t *positions = b->positions.buf, *starts = b->starts.buf;
    if (b->positions.len % 8 || b->starts.len % 8 || num_bags < 0) return "bad id arrays";
    if (b->weights.buf != NULL && b->weights.len != count * item)
        return "one weight per id is needed";
    if (b->pooled.buf != NULL && b->pooled.len != num_bags * dim * item)
        return "one pooled row per bag is needed";
    if (starts[0] != 0 || starts[num_bags] != count) return "bags must cover the ids";
    for (Py_ssize_t j = 0; j < num_bags; j++)
        if (starts[j + 1] < starts[j]) return "bags must not end before they start";
    for (Py_ssize_t i = 0; i < count; i++)
        if (positions[i] < 0 || positions[i] >= table_rows) return "a position past its table";
    return NULL;
}

static int export_bags(Moves *m, Py_ssize_t dim, int scatter, Py_ssize_t item) {
    const char *error = NULL;
    int pooled_flags = PyBUF_C_CONTIGUOUS | (scatter ? 0 : PyBUF_WRITABLE);
    Py_buffer *table_views = m->table_views;
    Py_ssize_t num_tables = m->num_tables;
    if (export_tables(m, item * dim, scatter, &error) < 0) return -1;
    for (Py_ssize_t j = 0; j < m->num_lookups && error == NULL; j++) {
        PyObject *item_object = PySequence_Fast_GET_ITEM(m->lookups, j), *weights, *pooled;
        Bags *b = &((Bags *)m->each)[j];
        if (!PyTuple_Check(item_object)) {
            PyErr_SetString(PyExc_TypeError, "a lookup is a (table, positions, starts, "
                                             "weights, padding, mean, in_order, pooled) tuple");
            return -1;
        }
        if (!PyArg_ParseTuple(item_object, "nO&O&OnppO", &b->table, buffer_converter,
                              &b->positions, buffer_converter, &b->starts, &weights,
                              &b->padding, &b->mean, &b->in_order, &pooled))
            return -1;
        if (optional_buffer(weights, &b->weights, PyBUF_C_CONTIGUOUS) < 0 ||
            optional_buffer(pooled, &b->pooled, pooled_flags) < 0)
            return -1;
        if (!scatter && b->pooled.buf == NULL) error = "a lookup without an output";
        else if (b->table < 0 || b->table >= num_tables) error = "a lookup of no table";
        else error = check_bags(b, table_views[b->table].len / item / dim, dim, item);
    }
    if (error != NULL) {
        PyErr_Format(PyExc_ValueError, "%s: %s", scatter ? "scatter_bags" : "pool_bags", error);
        return -1;
    }
    return 0;
}

/* The ids of bag j that are not the padding row. */
static inline Py_ssize_t bag_size(const Bags *b, Py_ssize_t j) {
    const int64_t *positions = b->positions.buf, *starts = b->starts.buf;
    Py_ssize_t size = 0;
    for (int64_t i = starts[j]; i < starts[j + 1]; i++) size += positions[i] != b->padding;
    return size;
}

/* How many of a bag's sums pool_bags keeps in registers at once (a row of up to this many is
 * read once), and how many ids ahead it asks for a row's cache lines (rows are scattered over
 * the pulled rows: a miss each, as fbgemm's kernel, which prefetches as far, knows). */
#define POOL_BLOCK 16
#define POOL_PREFETCH 16

#define POOL_BAGS(T, FMA)                                                                    \
    /* sums[0..POOL_BLOCK) := the sum from zero of columns offset.. of rows `at` of `table`  \
     * (`dim` wide) for ids first to end but those at `padding`, in order. Only loops of     \
     * constant length touch acc, so the compiler keeps it in registers (in memory, each     \
     * row's add would wait on the last one's store). */                                    \
    static inline void sum_block_##T(T *restrict sums, const T *restrict table,             \
                                     const int64_t *restrict at, int64_t first, int64_t end, \
                                     int64_t count, Py_ssize_t dim, Py_ssize_t offset,       \
                                     int64_t padding) {                                      \
        T acc[POOL_BLOCK] = {0};                                                             \
        for (int64_t i = first; i < end; i++) {                                              \
            if (offset == 0 && i + POOL_PREFETCH < count)                                    \
                __builtin_prefetch(table + at[i + POOL_PREFETCH] * dim);                     \
            if (at[i] == padding) continue;                                                  \
            const T *row = table + at[i] * dim + offset;                                     \
            for (Py_ssize_t k = 0; k < POOL_BLOCK; k++) acc[k] += row[k];                    \
        }                                                                                    \
        for (Py_ssize_t k = 0; k < POOL_BLOCK; k++) sums[k] = acc[k];                        \
    }                                                                                        \
    /* sum_block's sums for any width <= POOL_BLOCK, each row times its weight where given:  \
     * a multiply-add rounded once where `fused`, else the product rounded first. */        \
    static void sum_columns_##T(T *restrict sums, const T *restrict table,                  \
                                const int64_t *restrict at, const T *weights, int64_t first, \
                                int64_t end, Py_ssize_t dim, Py_ssize_t offset,              \
                                Py_ssize_t width, int64_t padding, int fused) {              \
        for (Py_ssize_t k = 0; k < width; k++) sums[k] = 0;                                  \
        for (int64_t i = first; i < end; i++) {                                              \
            if (at[i] == padding) continue;                                                  \
            const T *row = table + at[i] * dim + offset;                                     \
            T w = weights != NULL ? weights[i] : 1;                                          \
            if (weights == NULL)                                                             \
                for (Py_ssize_t k = 0; k < width; k++) sums[k] += row[k];                    \
            else if (fused)                                                                  \
                for (Py_ssize_t k = 0; k < width; k++) sums[k] = FMA(w, row[k], sums[k]);    \
            else                                                                             \
                for (Py_ssize_t k = 0; k < width; k++) sums[k] += w * row[k];                \
        }                                                                                    \
    }                                                                                        \
    static void pool_bags_##T(const Bags *b, const T *table, Py_ssize_t dim) {              \
        const int64_t *positions = b->positions.buf, *starts = b->starts.buf;                \
        const T *weights = b->weights.buf;                                                   \
        /* fbgemm's kernel (float32 bags without padding) fuses a weight's multiply-add;     \
         * torch's own loop (the rest) rounds the product first. */                          \
        int fused = sizeof(T) == 4 && b->padding < 0;                                        \
        T *out = b->pooled.buf;                                                              \
        Py_ssize_t num_bags = b->starts.len / 8 - 1, count = b->positions.len / 8;           \
        for (Py_ssize_t j = 0; j < num_bags; j++) {                                          \
            /* Each sum from zero, its terms in the bag's order: a block at a time changes   \
             * which sums are added when, not any sum's operations. */                       \
            for (Py_ssize_t k0 = 0; k0 < dim; k0 += POOL_BLOCK) {                            \
                Py_ssize_t width = dim - k0 < POOL_BLOCK ? dim - k0 : POOL_BLOCK;            \
                T *sums = out + j * dim + k0;                                                \
                if (weights == NULL && width == POOL_BLOCK)                                  \
                    sum_block_##T(sums, table, positions, starts[j], starts[j + 1], count,   \
                                  dim, k0, b->padding);                                      \
                else                                                                         \
                    sum_columns_##T(sums, table, positions, weights, starts[j],              \
                                    starts[j + 1], dim, k0, width, b->padding, fused);       \
            }                                                                                \
            Py_ssize_t size = b->mean ? bag_size(b, j) : 0;                                  \
            for (Py_ssize_t k = 0; k < dim && size > 0; k++) out[j * dim + k] /= (T)size;   \
        }                                                                                    \
    }                                                                                        \
    /* row += scale * grad (the product rounded first; a scale of 1 adds grad exactly), `dim` \
     * wide: a block of constant length at a time, which the compiler vectorizes (each       \
     * element's operations unchanged). */                                                  \
    static inline void add_row_##T(T *restrict row, const T *restrict grad, Py_ssize_t dim,  \
                                   T scale) {                                                \
        Py_ssize_t k = 0;                                                                    \
        for (; k + POOL_BLOCK <= dim; k += POOL_BLOCK)                                       \
            for (Py_ssize_t c = 0; c < POOL_BLOCK; c++) row[k + c] += scale * grad[k + c];   \
        for (; k < dim; k++) row[k] += scale * grad[k];                                      \
    }                                                                                        \
    /* In order: bag by bag, each id's share (its weight, or 1 / the bag's size for a mean,  \
     * rounded to T) times the bag's gradient rounded, then added. Rows are scattered over   \
     * the table's gradients: each asked for POOL_PREFETCH ids ahead, as pool_bags does. */  \
    static void scatter_in_order_##T(const Bags *b, T *grads, Py_ssize_t dim) {             \
        const int64_t *positions = b->positions.buf, *starts = b->starts.buf;                \
        const T *pooled = b->pooled.buf, *weights = b->weights.buf;                          \
        Py_ssize_t num_bags = b->starts.len / 8 - 1, count = b->positions.len / 8;           \
        for (Py_ssize_t j = 0; j < num_bags; j++) {                                          \
            const T *grad = pooled + j * dim;                                                \
            Py_ssize_t size = b->mean ? bag_size(b, j) : 0;                                  \
            T share = (T)(size > 0 ? 1.0 / (double)size : 1.0);                              \
            for (int64_t i = starts[j]; i < starts[j + 1]; i++) {                            \
                if (i + POOL_PREFETCH < count)                                               \
                    __builtin_prefetch(grads + positions[i + POOL_PREFETCH] * dim, 1);       \
                if (positions[i] == b->padding) continue;                                    \
                add_row_##T(grads + positions[i] * dim, grad, dim,                           \
                            weights != NULL ? weights[i] : share);                           \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    /* As torch's dense backward: `bag_of`, each id's bag, `scale`, its share (set by       \
     * bag_shares); `order`: the order to visit the ids in (NULL: theirs). */               \
    static void scatter_bags_##T(const Bags *b, T *grads, Py_ssize_t dim,                   \
                                 const int64_t *bag_of, const double *scale,                 \
                                 const int64_t *order) {                                     \
        const int64_t *positions = b->positions.buf;                                         \
        const T *pooled = b->pooled.buf;                                                     \
        Py_ssize_t count = b->positions.len / 8;                                             \
        int plain = b->weights.buf == NULL && !b->mean;                                      \
        for (Py_ssize_t n = 0; n < count; n++) {                                             \
            Py_ssize_t i = order != NULL ? order[n] : n;                                     \
            if (positions[i] == b->padding) continue;                                        \
            T *row = grads + positions[i] * dim;                                             \
            const T *grad = pooled + bag_of[i] * dim;                                        \
            if (plain) {                                                                     \
                for (Py_ssize_t k = 0; k < dim; k++) row[k] += grad[k];                      \
            } else {                                                                         \
                T share = (T)scale[i];                                                       \
                for (Py_ssize_t k = 0; k < dim; k++) row[k] = FMA(share, grad[k], row[k]);   \
            }                                                                                \
        }                                                                                    \
    }

POOL_BAGS(float, fmaf)
POOL_BAGS(double, fma)

/* Each id's bag (bag_of) and its share of the bag's gradient (scale), as torch's backward
 * makes it in double before rounding it to the rows' type: its weight, or 1 / the bag's ids
 * that are not padding for a mean. */
static void bag_shares(const Bags *b, int wide, int64_t *bag_of, double *scale) {
    const int64_t *starts = b->starts.buf;
    Py_ssize_t num_bags = b->starts.len / 8 - 1;
    for (Py_ssize_t j = 0; j < num_bags; j++) {
        double share = 1.0;
        if (b->mean) {
            Py_ssize_t size = bag_size(b, j);
            if (size > 0) share /= (double)size;
        }
        for (int64_t i = starts[j]; i < starts[j + 1]; i++) {
            bag_of[i] = j;
            if (b->weights.buf == NULL) scale[i] = share;
            else scale[i] = wide ? ((const double *)b->weights.buf)[i]
                                 : (double)((const float *)b->weights.buf)[i];
        }
    }
}

static PyObject *move_bags(PyObject *args, int scatter) {
    PyObject *tables_arg, *lookups_arg, *result = NULL;
    Py_ssize_t dim;
    int wide;
    /* scatter's: each id's bag, its share (a double), the order to visit the ids in, and
     * torch_sort_order's pairs (the last two where a lookup has fewer ids than
     * TORCH_RADIX_SORT_FROM) */
    int64_t *workspace = NULL;
    if (!PyArg_ParseTuple(args, "OOnp", &tables_arg, &lookups_arg, &dim, &wide)) return NULL;
    if (dim <= 0 || dim > PY_SSIZE_T_MAX / 16) {
        PyErr_SetString(PyExc_ValueError, "rows of width < 1, or too wide");
        return NULL;
    }
    Py_ssize_t item = wide ? 8 : 4;
    Moves m;
    if (open_moves(tables_arg, lookups_arg, sizeof(Bags), &m) < 0 ||
        export_bags(&m, dim, scatter, item) < 0)
        goto done;
    Bags *each = m.each;
    Py_buffer *table_views = m.table_views;
    Py_ssize_t num_lookups = m.num_lookups;
    /* The most ids of a lookup added back as torch's dense backward, and of one torch sorts
     * by std::sort: workspace sizes (one added in order needs none). */
    Py_ssize_t most = 1, most_sorted = 1;
    for (Py_ssize_t j = 0; j < num_lookups; j++) {
        Py_ssize_t count = each[j].positions.len / 8;
        if (each[j].in_order) continue;
        if (count > most) most = count;
        if (count < TORCH_RADIX_SORT_FROM && count > most_sorted) most_sorted = count;
    }
    if (scatter && (workspace = PyMem_Malloc(most * 16 + most_sorted * 24)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *bag_of = workspace, *order = workspace + 2 * most;
    double *scale = (double *)(workspace + most);
    void *pairs = workspace + 2 * most + most_sorted;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < num_lookups; j++) {
        void *table = table_views[each[j].table].buf;
        Py_ssize_t count = each[j].positions.len / 8;
        if (scatter && each[j].pooled.buf == NULL) continue;
        if (scatter && each[j].in_order) {
            if (wide) scatter_in_order_double(&each[j], table, dim);
            else scatter_in_order_float(&each[j], table, dim);
        } else if (scatter) {
            bag_shares(&each[j], wide, bag_of, scale);
            int sorted = count < TORCH_RADIX_SORT_FROM;
            if (sorted) torch_sort_order(each[j].positions.buf, count, order, pairs);
            if (wide)
                scatter_bags_double(&each[j], table, dim, bag_of, scale, sorted ? order : NULL);
            else
                scatter_bags_float(&each[j], table, dim, bag_of, scale, sorted ? order : NULL);
        } else if (wide) {
            pool_bags_double(&each[j], table, dim);
        } else {
            pool_bags_float(&each[j], table, dim);
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t j = 0; j < m.num_lookups && m.each != NULL; j++) {
        Bags *b = &((Bags *)m.each)[j];
        release(&b->positions);
        release(&b->starts);
        release(&b->weights);
        release(&b->pooled);
    }
    PyMem_Free(workspace);
    close_moves(&m);
    return result;
}

static const char pool_bags_doc[] =
    "pool_bags(tables, lookups, dim, wide)\n"
    "Each lookup (table, positions, starts, weights, padding, mean, in_order, out) of\n"
    "`lookups` sums the rows `positions` (int64) of tables[table] bag by bag (bag j: ids\n"
    "starts[j] to starts[j + 1]) into out's row j, in order from zero, times each id's weight\n"
    "(None: 1), skipping position `padding` (-1: none); a mean divides by the ids summed\n"
    "(in_order: how scatter_bags adds the gradients). Tables, weights and out: float32 rows\n"
    "`dim` wide, float64 where `wide`.";

static PyObject *pool_bags(PyObject *self, PyObject *args) { return move_bags(args, 0); }

static const char scatter_bags_doc[] =
    "scatter_bags(tables, lookups, dim, wide)\n"
    "pool_bags' backward: each lookup's (as pool_bags', `out` now its bags' gradients, None:\n"
    "none) bag gradient, times each id's weight (a mean: 1 / its size), added into\n"
    "tables[table]'s row of each id but the padding. Where `in_order`: id by id as given, each\n"
    "product rounded first (torch's sparse gradient, made dense); else by a multiply-add, id by\n"
    "id in the order of torch.sort(positions) (sort_order's below TORCH_RADIX_SORT_FROM ids,\n"
    "else stable), as torch's dense backward.";

static PyObject *scatter_bags(PyObject *self, PyObject *args) { return move_bags(args, 1); }

static const char sort_order_doc[] =
    "sort_order(keys, order)\n"
    "order (int64, writable) := the permutation std::sort puts keys (int64, as many) in,\n"
    "comparing keys only: torch.sort(keys).indices below TORCH_RADIX_SORT_FROM keys, the\n"
    "order scatter_bags visits a lookup's ids in there.";

static PyObject *sort_order(PyObject *self, PyObject *args) {
    Py_buffer keys = {0}, order = {0};
    void *pairs = NULL;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "O&O&", readable, &keys, writable, &order)) return NULL;
    Py_ssize_t count = keys.len / 8;
    if (keys.len % 8 || order.len != keys.len) {
        PyErr_SetString(PyExc_ValueError, "sort_order: keys and order are int64, as many");
        goto done;
    }
    if ((pairs = PyMem_Malloc(count ? count * 16 : 1)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    torch_sort_order(keys.buf, count, order.buf, pairs);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(pairs);
    release_buffer(&keys);
    release_buffer(&order);
    return result;
}

/* Every buffer of the sequence `arg`, exported (contiguous, `itemsize` bytes an item, its
 * format one of `formats`) into views[]; returns their number, or -1 with TypeError (or the
 * export's error) set and nothing left exported. *views is PyMem_Free'd by the caller. */
static Py_ssize_t export_all(PyObject *arg, Py_ssize_t itemsize, const char *formats,
                             Py_buffer **views, const char *caller) {
    *views = NULL;
    PyObject *items = PySequence_Fast(arg, "a sequence of arrays is required");
    if (items == NULL) return -1;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(items), exported = 0;
    *views = PyMem_Calloc(count ? count : 1, sizeof(Py_buffer));
    if (*views == NULL) {
        PyErr_NoMemory();
        count = -1;
    }
    for (; count > 0 && exported < count; exported++) {
        Py_buffer *view = &(*views)[exported];
        if (get_buffer(PySequence_Fast_GET_ITEM(items, exported), view,
                               PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            break;
        const char *format = view->format ? view->format : "B";
        if (format[0] == '@' || format[0] == '=' || format[0] == '<') format++;
        if (view->itemsize != itemsize || format[0] == '\0' || format[1] != '\0' ||
            strchr(formats, format[0]) == NULL) {
            release_buffer(view);
            PyErr_Format(PyExc_TypeError, "%s: array %zd has items of another type", caller,
                         exported);
            break;
        }
    }
    if (count > 0 && exported < count) {
        for (Py_ssize_t i = 0; i < exported; i++) release_buffer(&(*views)[i]);
        count = -1;
    }
    Py_DECREF(items);
    return count;
}

static const char all_finite_doc[] =
    "all_finite(arrays)\n"
    "Whether every value of `arrays` (each contiguous float32) is finite: no NaN or Inf.";

static PyObject *all_finite(PyObject *self, PyObject *arg) {
    Py_buffer *views;
    Py_ssize_t count = export_all(arg, 4, "f", &views, "all_finite");
    if (count < 0) {
        PyMem_Free(views);
        return NULL;
    }
    /* A float32 is NaN or Inf exactly when its exponent's bits are all set: then adding one
     * to the exponent carries into the top bit, which nothing else reaches. An OR of those
     * sums over all values, in operations the compiler vectorizes (a float sum it may not). */
    uint32_t carries = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < count; j++) {
        const uint32_t *bits = views[j].buf;
        Py_ssize_t size = views[j].len / 4;
        for (Py_ssize_t i = 0; i < size; i++) carries |= (bits[i] & 0x7f800000u) + 0x00800000u;
    }
    Py_END_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < count; j++) release_buffer(&views[j]);
    PyMem_Free(views);
    return PyBool_FromLong(!(carries & 0x80000000u));
}

static const char ascending_within_doc[] =
    "ascending_within(arrays, bounds)\n"
    "Whether each array of `arrays` (contiguous int64) rises strictly and lies within its\n"
    "bounds: bounds[i] is (low, high), both included.";

static PyObject *ascending_within(PyObject *self, PyObject *args) {
    PyObject *arrays_arg, *bounds_arg, *result = NULL;
    if (!PyArg_ParseTuple(args, "OO", &arrays_arg, &bounds_arg)) return NULL;
    PyObject *bounds = PySequence_Fast(bounds_arg, "ascending_within: bounds must be a sequence");
    if (bounds == NULL) return NULL;
    Py_buffer *views;
    Py_ssize_t count = export_all(arrays_arg, 8, "lq", &views, "ascending_within");
    if (count < 0) goto done;
    if (PySequence_Fast_GET_SIZE(bounds) != count) {
        PyErr_SetString(PyExc_ValueError, "ascending_within: one (low, high) per array");
        goto release;
    }
    int inside = 1;
    for (Py_ssize_t j = 0; j < count && inside; j++) {
        long long low, high;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(bounds, j), "LL", &low, &high))
            goto release;
        const int64_t *ids = views[j].buf;
        Py_ssize_t size = views[j].len / 8;
        inside = size == 0 || (ids[0] >= low && ids[size - 1] <= high);
    }
    unsigned int falls = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < count && inside; j++) {
        const int64_t *ids = views[j].buf;
        Py_ssize_t size = views[j].len / 8;
        for (Py_ssize_t i = 1; i < size; i++) falls |= ids[i] <= ids[i - 1];
    }
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(inside && !falls);
release:
    for (Py_ssize_t j = 0; j < count; j++) release_buffer(&views[j]);
done:
    PyMem_Free(views);
    Py_DECREF(bounds);
    return result;
}

static const char places_each_doc[] =
    "places_each(values, value_sizes, others, other_sizes, at_out, found_out)\n"
    "For each segment of `values` (int64; `value_sizes`, a tuple, their lengths in order) and\n"
    "the same-numbered segment of `others` (sorted; `other_sizes`): each value's place in its\n"
    "others, numpy's searchsorted (left) capped at the last, into at_out (int64), and whether\n"
    "it is there into found_out (bool, one byte each); a segment with no others: 0, false.";

/* The segments' sizes in `sizes` (a tuple), summed; -1 with ValueError set where one is
 * negative or they pass `total`. */
static Py_ssize_t summed_sizes(PyObject *sizes, Py_ssize_t total) {
    Py_ssize_t summed = 0;
    for (Py_ssize_t s = 0; s < PyTuple_GET_SIZE(sizes); s++) {
        Py_ssize_t size = PyLong_AsSsize_t(PyTuple_GET_ITEM(sizes, s));
        if (size == -1 && PyErr_Occurred()) return -1;
        if (size < 0 || size > total - summed) break;
        summed += size;
    }
    if (summed != total) {
        PyErr_SetString(PyExc_ValueError, "places_each: sizes that do not sum to the arrays");
        return -1;
    }
    return summed;
}

/* Each value's first place among `others` whose other is not below it: where the values rise
 * (a prefetched step's sorted ids) a walk on from the last value's place, one pass over both
 * (a binary search per value costs a missed branch per halving); else a binary search below
 * the last place. */
static void places_segment(const int64_t *values, Py_ssize_t n, const int64_t *others,
                           Py_ssize_t m, int64_t *at, char *found) {
    int ascending = 1;
    for (Py_ssize_t i = 1; i < n; i++) ascending &= values[i] >= values[i - 1];
    if (ascending && m > 0) { /* the usual case: one merge, with no branch a value */
        Py_ssize_t i = 0, j = 0;
        while (i < n && j < m) {
            int behind = others[j] < values[i];
            at[i] = j; /* kept once values[i] is not behind others[j] */
            j += behind;
            i += !behind;
        }
        for (; i < n; i++) at[i] = m;
        for (i = 0; i < n; i++) {
            at[i] = at[i] < m ? at[i] : m - 1;
            found[i] = others[at[i]] == values[i];
        }
        return;
    }
    Py_ssize_t low = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i > 0 && values[i] < values[i - 1]) {
            Py_ssize_t high = low;
            low = 0;
            while (low < high) {
                Py_ssize_t mid = low + (high - low) / 2;
                if (others[mid] < values[i]) low = mid + 1;
                else high = mid;
            }
        }
        while (low < m && others[low] < values[i]) low++;
        Py_ssize_t place = m == 0 ? 0 : (low < m ? low : m - 1);
        at[i] = place;
        found[i] = m != 0 && others[place] == values[i];
    }
}

static PyObject *places_each(PyObject *self, PyObject *args) {
    Py_buffer values_view, others_view, at_view, found_view;
    PyObject *value_sizes, *other_sizes, *result = NULL;
    if (!PyArg_ParseTuple(args, "O&O!O&O!O&O&", readable, &values_view, &PyTuple_Type,
                          &value_sizes, readable, &others_view, &PyTuple_Type, &other_sizes,
                          writable, &at_view, writable, &found_view))
        return NULL;
    Py_ssize_t segments = PyTuple_GET_SIZE(value_sizes);
    if (values_view.len % 8 || others_view.len % 8 || at_view.len != values_view.len ||
        found_view.len != values_view.len / 8 || PyTuple_GET_SIZE(other_sizes) != segments) {
        PyErr_SetString(PyExc_ValueError, "places_each: arrays of mismatched sizes");
        goto done;
    }
    if (summed_sizes(value_sizes, values_view.len / 8) < 0 ||
        summed_sizes(other_sizes, others_view.len / 8) < 0)
        goto done;
    Py_ssize_t value_start = 0, other_start = 0;
    for (Py_ssize_t s = 0; s < segments; s++) {
        Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(value_sizes, s));
        Py_ssize_t m = PyLong_AsSsize_t(PyTuple_GET_ITEM(other_sizes, s));
        places_segment((const int64_t *)values_view.buf + value_start, n,
                       (const int64_t *)others_view.buf + other_start, m,
                       (int64_t *)at_view.buf + value_start, (char *)found_view.buf + value_start);
        value_start += n;
        other_start += m;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release_buffer(&values_view);
    release_buffer(&others_view);
    release_buffer(&at_view);
    release_buffer(&found_view);
    return result;
}

/* pack_steps: the row ids of a request's every table and server (each part sorted unique) as
 * the wire carries them (paramserver/wire/idcodec.py): each part's first id and the steps
 * between its ids, in the narrowest of uint8, int16 and int32 that holds its largest step. */
enum { STEPS_U8 = 0, STEPS_I16 = 1, STEPS_I32 = 2, STEPS_NONE = 3 };

/* The bytes a step of type `code` takes (STEPS_NONE: an int64 id). */
static inline Py_ssize_t steps_width(int64_t code) {
    return code == STEPS_U8 ? 1 : code == STEPS_I16 ? 2 : code == STEPS_I32 ? 4 : 8;
}

/* The code of the narrowest type that holds every step between `ids` (sorted unique), or
 * STEPS_NONE where none does, or their span passes int64 (the ids travel as they are). */
static int step_code(const int64_t *ids, Py_ssize_t count) {
    int64_t first = count ? ids[0] : 0, largest = 0, span;
    int overflow = 0;
    for (Py_ssize_t i = 1; i < count; i++) {
        int64_t step;
        if (__builtin_sub_overflow(ids[i], ids[i - 1], &step)) overflow = 1;
        else if (step > largest) largest = step;
    }
    if (count && (overflow || __builtin_sub_overflow(ids[count - 1], first, &span)))
        return STEPS_NONE;
    if (largest > INT32_MAX) return STEPS_NONE;
    return largest <= UINT8_MAX ? STEPS_U8 : largest <= INT16_MAX ? STEPS_I16 : STEPS_I32;
}

/* `ids`' steps (steps[0] = 0) written to `to` in the type of `code`; STEPS_NONE: the ids. */
static void write_steps(char *to, const int64_t *ids, Py_ssize_t count, int code) {
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t step = i ? ids[i] - ids[i - 1] : 0;
        if (code == STEPS_U8) ((uint8_t *)to)[i] = (uint8_t)step;
        else if (code == STEPS_I16) ((int16_t *)to)[i] = (int16_t)step;
        else if (code == STEPS_I32) ((int32_t *)to)[i] = (int32_t)step;
        else ((int64_t *)to)[i] = ids[i];
    }
}

static const char pack_steps_doc[] =
    "pack_steps(parts, out) -> ((first, code, offset), ...)\n"
    "For each part (1-D int64, sorted unique): its first id, the code of its steps' type (0:\n"
    "uint8, 1: int16, 2: int32; 3: none holds them, or the span passes int64: the ids travel\n"
    "as they are) and where in `out` (bytes) its steps start, aligned to 8; steps[0] is 0.\n"
    "`out` holds at least 4 * (ids) + 8 * (parts) bytes. An empty part: (0, 0, 0).";

static PyObject *pack_steps(PyObject *self, PyObject *args) {
    PyObject *parts_arg, *result = NULL;
    Py_buffer out_view;
    if (!PyArg_ParseTuple(args, "OO&", &parts_arg, writable, &out_view)) return NULL;
    PyObject *parts = PySequence_Fast(parts_arg, "pack_steps: parts must be a sequence");
    if (parts == NULL) {
        release_buffer(&out_view);
        return NULL;
    }
    Py_ssize_t num_parts = PySequence_Fast_GET_SIZE(parts), at = 0;
    result = PyTuple_New(num_parts);
    for (Py_ssize_t j = 0; result != NULL && j < num_parts; j++) {
        Py_buffer view;
        if (get_buffer(PySequence_Fast_GET_ITEM(parts, j), &view, PyBUF_C_CONTIGUOUS) < 0)
            goto failed;
        if (view.len % 8) {
            release_buffer(&view);
            PyErr_SetString(PyExc_ValueError, "pack_steps: a part is not int64 ids");
            goto failed;
        }
        const int64_t *ids = view.buf;
        Py_ssize_t count = view.len / 8;
        int64_t first = count ? ids[0] : 0;
        int code = step_code(ids, count);
        Py_ssize_t offset = 0;
        if (count && code != STEPS_NONE) {
            Py_ssize_t width = steps_width(code);
            offset = (at + 7) / 8 * 8;
            if (offset + count * width > out_view.len) {
                release_buffer(&view);
                PyErr_SetString(PyExc_ValueError, "pack_steps: out is too short");
                goto failed;
            }
            write_steps((char *)out_view.buf + offset, ids, count, code);
            at = offset + count * width;
        }
        release_buffer(&view);
        PyObject *entry = Py_BuildValue("(Lin)", (long long)first, code, offset);
        if (entry == NULL) goto failed;
        PyTuple_SET_ITEM(result, j, entry);
    }
    Py_DECREF(parts);
    release_buffer(&out_view);
    return result;
failed:
    Py_XDECREF(result);
    Py_DECREF(parts);
    release_buffer(&out_view);
    return NULL;
}

/* unpack_steps: the inverse of pack_steps on a server, with packed_problem's checks (wire/
 * idcodec.py): every set of a request's packed ids in one call. */
static const char unpack_steps_doc[] =
    "unpack_steps(parts, out) -> index of the first malformed part, or -1\n"
    "Each part is (first, code, steps): a first id within int64, its steps' type (0: uint8,\n"
    "1: int16, 2: int32) and the steps, 1-D. Writes each part's ids, first + the running sum of\n"
    "its steps, end to end in `out` (int64, one per step of all parts). A part is malformed\n"
    "where a step is negative, a step after its first is 0 (ids must be unique) or an id\n"
    "passes int64; the parts after it are not written.";

static PyObject *unpack_steps(PyObject *self, PyObject *args) {
    PyObject *parts_arg;
    Py_buffer out_view;
    if (!PyArg_ParseTuple(args, "OO&", &parts_arg, writable, &out_view)) return NULL;
    PyObject *parts = PySequence_Fast(parts_arg, "unpack_steps: parts must be a sequence");
    if (parts == NULL) {
        release_buffer(&out_view);
        return NULL;
    }
    Py_ssize_t num_parts = PySequence_Fast_GET_SIZE(parts), at = 0, malformed = -1;
    int64_t *out = out_view.buf;
    Py_ssize_t capacity = out_view.len / 8;
    for (Py_ssize_t j = 0; j < num_parts && malformed < 0; j++) {
        long long first;
        int code;
        PyObject *steps_arg;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(parts, j), "LiO", &first, &code, &steps_arg))
            goto failed;
        Py_ssize_t width = code == STEPS_U8 ? 1 : code == STEPS_I16 ? 2 : code == STEPS_I32 ? 4 : 0;
        Py_buffer view;
        if (width == 0) {
            PyErr_SetString(PyExc_ValueError, "unpack_steps: unknown step type");
            goto failed;
        }
        if (get_buffer(steps_arg, &view, PyBUF_C_CONTIGUOUS) < 0) goto failed;
        Py_ssize_t count = view.len / width;
        if (view.len % width || count > capacity - at) {
            release_buffer(&view);
            PyErr_SetString(PyExc_ValueError, "unpack_steps: steps and out do not match");
            goto failed;
        }
        int64_t id = first, *ids = out + at;
        for (Py_ssize_t i = 0; i < count; i++) {
            int64_t step = code == STEPS_U8    ? ((const uint8_t *)view.buf)[i]
                           : code == STEPS_I16 ? ((const int16_t *)view.buf)[i]
                                               : ((const int32_t *)view.buf)[i];
            if (step < 0 || (i > 0 && step == 0) || __builtin_add_overflow(id, step, &id)) {
                malformed = j;
                break;
            }
            ids[i] = id;
        }
        release_buffer(&view);
        at += count;
    }
    Py_DECREF(parts);
    release_buffer(&out_view);
    return PyLong_FromSsize_t(malformed);
failed:
    Py_DECREF(parts);
    release_buffer(&out_view);
    return NULL;
}

/* pack_tables, unpack_tables: the row ids of several tables as one message carries them to one
 * server (wire/idcodec.py's PackedTables): per table its first id (`firsts`), its count of
 * ids and the code of its steps' type in one int32 (`sizes`: count * 4 + code), and its steps
 * (or, code 3, its int64 ids) in one byte buffer, each table's from an offset aligned to 8
 * after the one before's. */
#define MOST_TABLE_IDS ((int64_t)1 << 29) /* a count that fits sizes beside its code */

static const char pack_tables_doc[] =
    "pack_tables(parts, firsts, sizes, data) -> bytes of data used\n"
    "Each part (1-D int64, sorted unique, under 2^29 ids) packed as pack_steps packs it: its\n"
    "first id in `firsts` (int64), its count * 4 + the code of its steps' type in `sizes`\n"
    "(int32; code 3: no step type holds them, and its ids travel), its steps or ids in `data`\n"
    "from the last part's end aligned to 8. `data` holds at least 8 * (ids + parts) bytes.";

static PyObject *pack_tables(PyObject *self, PyObject *args) {
    PyObject *parts_arg;
    Py_buffer firsts_view, sizes_view, data_view;
    if (!PyArg_ParseTuple(args, "OO&O&O&", &parts_arg, writable, &firsts_view, writable,
                          &sizes_view, writable, &data_view))
        return NULL;
    PyObject *parts = PySequence_Fast(parts_arg, "pack_tables: parts must be a sequence");
    Py_ssize_t at = 0;
    if (parts == NULL) goto failed;
    Py_ssize_t num_parts = PySequence_Fast_GET_SIZE(parts);
    if (firsts_view.len < num_parts * 8 || sizes_view.len < num_parts * 4) {
        PyErr_SetString(PyExc_ValueError, "pack_tables: firsts or sizes is too short");
        goto failed;
    }
    int64_t *firsts = firsts_view.buf;
    int32_t *sizes = sizes_view.buf;
    for (Py_ssize_t j = 0; j < num_parts; j++) {
        Py_buffer view;
        if (get_buffer(PySequence_Fast_GET_ITEM(parts, j), &view, PyBUF_C_CONTIGUOUS) < 0)
            goto failed;
        const int64_t *ids = view.buf;
        Py_ssize_t count = view.len / 8;
        int code = step_code(ids, count);
        Py_ssize_t width = steps_width(code), offset = (at + 7) / 8 * 8;
        if (view.len % 8 || count >= MOST_TABLE_IDS || offset + count * width > data_view.len) {
            release_buffer(&view);
            PyErr_SetString(PyExc_ValueError, "pack_tables: a part is not int64 ids, has 2^29 "
                                              "or more, or data is too short");
            goto failed;
        }
        write_steps((char *)data_view.buf + offset, ids, count, code);
        firsts[j] = count ? ids[0] : 0;
        sizes[j] = (int32_t)(count * 4 + code);
        at = offset + count * width;
        release_buffer(&view);
    }
    Py_DECREF(parts);
    release_buffer(&firsts_view);
    release_buffer(&sizes_view);
    release_buffer(&data_view);
    return PyLong_FromSsize_t(at);
failed:
    Py_XDECREF(parts);
    release_buffer(&firsts_view);
    release_buffer(&sizes_view);
    release_buffer(&data_view);
    return NULL;
}

static const char unpack_tables_doc[] =
    "unpack_tables(firsts, sizes, data, out) -> (problem, table)\n"
    "A peer's packed tables (see pack_tables) unpacked into `out` (int64, one per id), every\n"
    "table's ids end to end. problem 0: none; 1: the sizes do not lay their tables out in\n"
    "`data` exactly (a negative size, a table past the data, data left over), or their counts\n"
    "do not fill `out`, or firsts and sizes differ in length; 2: table `table`'s steps are\n"
    "malformed (a negative step, a step of 0 after the first, an id past int64), the tables\n"
    "after it not written. The ids of code 3 are copied as they are (the caller checks them).";

static PyObject *unpack_tables(PyObject *self, PyObject *args) {
    Py_buffer firsts_view, sizes_view, data_view, out_view;
    if (!PyArg_ParseTuple(args, "O&O&O&O&", readable, &firsts_view, readable, &sizes_view, readable,
                          &data_view, writable, &out_view))
        return NULL;
    const int64_t *firsts = firsts_view.buf;
    const int32_t *sizes = sizes_view.buf;
    const char *data = data_view.buf;
    int64_t *out = out_view.buf;
    Py_ssize_t num_tables = sizes_view.len / 4, at = 0, written = 0, capacity = out_view.len / 8;
    int problem = sizes_view.len % 4 != 0 || firsts_view.len != num_tables * 8;
    /* The layout first, whole: nothing is written for a peer's sizes that do not fit. */
    for (Py_ssize_t j = 0; j < num_tables && !problem; j++) {
        int64_t code = sizes[j] & 3, count = sizes[j] >> 2;
        Py_ssize_t offset = (at + 7) / 8 * 8;
        if (sizes[j] < 0 || offset + count * steps_width(code) > data_view.len ||
            count > capacity - written)
            problem = 1;
        else {
            at = offset + count * steps_width(code);
            written += count;
        }
    }
    if (!problem && (at != data_view.len || written != capacity)) problem = 1;
    Py_ssize_t table = -1;
    at = 0;
    for (Py_ssize_t j = 0; j < num_tables && !problem; j++) {
        int64_t id = firsts[j], code = sizes[j] & 3, count = sizes[j] >> 2;
        Py_ssize_t offset = (at + 7) / 8 * 8;
        const char *from = data + offset;
        if (code == STEPS_NONE)
            memcpy(out, from, count * 8);
        else
            for (int64_t i = 0; i < count; i++) {
                int64_t step = code == STEPS_U8    ? ((const uint8_t *)from)[i]
                               : code == STEPS_I16 ? ((const int16_t *)from)[i]
                                                   : ((const int32_t *)from)[i];
                if (step < 0 || (i > 0 && step == 0) || __builtin_add_overflow(id, step, &id)) {
                    problem = 2;
                    table = j;
                    break;
                }
                out[i] = id;
            }
        out += count;
        at = offset + count * steps_width(code);
    }
    release_buffer(&firsts_view);
    release_buffer(&sizes_view);
    release_buffer(&data_view);
    release_buffer(&out_view);
    return Py_BuildValue("(in)", problem, table);
}

static PyMethodDef methods[] = {
    {"probe", probe, METH_VARARGS, probe_doc},
    {"place", place, METH_VARARGS, place_doc},
    {"rehash", rehash, METH_VARARGS, rehash_doc},
    {"step_rows", step_rows, METH_VARARGS, step_rows_doc},
    {"own_rows", own_rows, METH_VARARGS, own_rows_doc},
    {"init_rows", init_rows, METH_VARARGS, init_rows_doc},
    {"places_each", places_each, METH_VARARGS, places_each_doc},
    {"gather_rows", gather_rows, METH_VARARGS, gather_rows_doc},
    {"scatter_rows", scatter_rows, METH_VARARGS, scatter_rows_doc},
    {"pool_bags", pool_bags, METH_VARARGS, pool_bags_doc},
    {"scatter_bags", scatter_bags, METH_VARARGS, scatter_bags_doc},
    {"sort_order", sort_order, METH_VARARGS, sort_order_doc},
    {"all_finite", all_finite, METH_O, all_finite_doc},
    {"ascending_within", ascending_within, METH_VARARGS, ascending_within_doc},
    {"pack_steps", pack_steps, METH_VARARGS, pack_steps_doc},
    {"unpack_steps", unpack_steps, METH_VARARGS, unpack_steps_doc},
    {"pack_tables", pack_tables, METH_VARARGS, pack_tables_doc},
    {"unpack_tables", unpack_tables, METH_VARARGS, unpack_tables_doc},
#ifdef PARAMSERVER_TENSORS
    {"frame_tensor", (PyCFunction)(void (*)(void))frame_tensor, METH_FASTCALL,
     "frame_tensor(small, large, small_fn, large_fn, large_bytes, obj)\n"
     "A frame pickler's reducer_override (paramserver/wire/frames.py): a plain tensor's\n"
     "reduction, the tensor put in `small` or (of large_bytes or more) in `large`; else\n"
     "NotImplemented."},
    {"small_data", small_data, METH_VARARGS,
     "small_data(frame, small, at) -> end\n"
     "The small tensors' bytes laid out from `at`, each from an offset aligned to 8 (their\n"
     "elements in order), copied into the writable buffer `frame` (None: only measured);\n"
     "where they end, aligned too."},
    {"joined_tensors", joined_tensors, METH_O,
     "joined_tensors(values) -> the tensor `values` make up end to end, or None\n"
     "(paramserver/wire/bundles.py's joined_already)."},
    {"frame_small_tensor", frame_small_tensor, METH_VARARGS,
     "frame_small_tensor(data, at, dtype_name, shape) -> (tensor, end), or why not (a str)\n"
     "A frame's small tensor (paramserver/wire/frames.py): a writable view of the buffer\n"
     "`data` from `at` aligned to 8, which it keeps; where its data ends."},
    {"are_rows", are_rows, METH_VARARGS,
     "are_rows(tensors, float64_too) -> whether every one of the tuple `tensors` is a\n"
     "table of rows the loops index: a 2-D contiguous CPU tensor of float32 (or float64)."},
    {"unique_lookups", unique_lookups, METH_O,
     "unique_lookups(groups) -> [(unique, [(ids, positions), ...]), ...], or None\n"
     "For each table's list of lookups' ids (1-D int32 or int64 CPU tensors) of `groups`:\n"
     "its sorted unique ids and, per lookup, its ids copied as int64 and each one's index\n"
     "among them, as torch.unique(torch.cat(lookups), return_inverse=True) gives them, all\n"
     "views of one new buffer. None where an id tensor is of another kind."},
    {"bundle_values", (PyCFunction)(void (*)(void))bundle_values, METH_FASTCALL,
     "bundle_values(values, threshold) -> (shapes, flat), True, or None\n"
     "A mapping's values (a non-empty list) as one bundle (paramserver/wire/bundles.py):\n"
     "each one's shape and them end to end (the storage they fill already, else a copy);\n"
     "True where they are plain tensors of several dtypes, of threshold bytes or more in\n"
     "all; None where they are not all plain strided tensors, or fewer bytes."},
    {"unbundled_views", (PyCFunction)(void (*)(void))unbundled_views, METH_FASTCALL,
     "unbundled_views(names, shapes, flat) -> {name: view of flat}, or what is wrong (a str)\n"
     "A peer's bundle (paramserver/wire/bundles.py) checked whole, then its views."},
    {"payload_sizes", (PyCFunction)(void (*)(void))payload_sizes, METH_FASTCALL,
     "payload_sizes(special, field_names, mapping, message) -> (sent, uncompressed), or None\n"
     "A message's tensor data (paramserver/wire/sizing.py's payload_size): its tensors'\n"
     "bytes, walking dicts, lists, tuples, dataclasses (their fields by `field_names`) and\n"
     "other instances of `mapping`; an object whose type `special` holds counted by its\n"
     "function. None where a count passes int64."},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "paramserver's compiled loops (see native.py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *loops = PyModule_Create(&module);
    if (loops != NULL && PyModule_AddIntMacro(loops, TORCH_RADIX_SORT_FROM) < 0) Py_CLEAR(loops);
#ifdef PARAMSERVER_TENSORS /* and the torch release built with: native.py loads no other's */
    if (loops != NULL && (PyModule_AddIntConstant(loops, "TAKES_TENSORS", 1) < 0 ||
                          PyModule_AddStringConstant(loops, "TORCH_VERSION",
                                                     PARAMSERVER_TENSORS) < 0))
        Py_CLEAR(loops);
#else
    if (loops != NULL && PyModule_AddIntConstant(loops, "TAKES_TENSORS", 0) < 0) Py_CLEAR(loops);
#endif
#ifdef MAP_NORESERVE /* for mmap: address space whose pages are charged only once touched */
    if (loops != NULL && PyModule_AddIntMacro(loops, MAP_NORESERVE) < 0) Py_CLEAR(loops);
#endif
    return loops;
}
