/* What the compiled loops do with torch tensors (see _tensors.h): a tensor's memory as a
 * Py_buffer (the view holds a reference to the tensor, and its shape and strides, in bytes,
 * in one block of its own, freed at release), and a frame's tensors. Compiled only where
 * torch's headers are there to build with (setup.py). No C++ exception leaves a function
 * here: torch's become Python errors. */
#include <Python.h>

#include <algorithm>
#include <vector>
/* torch's headers use C++20's bit-field initializers, which g++ takes in C++17 with a warning. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wc++20-extensions"
#include <torch/csrc/autograd/python_variable.h>
#pragma GCC diagnostic pop

#include "_tensors.h"

namespace {

/* The buffer format of a dtype (struct module's codes, as numpy gives them), or nullptr. */
const char *format_of(c10::ScalarType type) {
    switch (type) {
        case c10::ScalarType::Float: return "f";
        case c10::ScalarType::Double: return "d";
        case c10::ScalarType::Half: return "e";
        case c10::ScalarType::Long: return "q";
        case c10::ScalarType::Int: return "i";
        case c10::ScalarType::Short: return "h";
        case c10::ScalarType::Char: return "b";
        case c10::ScalarType::Byte: return "B";
        case c10::ScalarType::Bool: return "?";
        default: return nullptr;
    }
}

/* Whether `object` is a tensor: by its type's MRO alone (THPVariable_Check may run Python's
 * isinstance, which must not run where an exception is pending, as at a failed call's
 * release). */
bool is_tensor(PyObject *object) {
    return THPVariableClass != nullptr &&
           PyObject_TypeCheck(object, reinterpret_cast<PyTypeObject *>(THPVariableClass));
}

/* A new tuple of `first` and `second` (stolen); nullptr where either is. */
PyObject *pair(PyObject *first, PyObject *second) {
    PyObject *made = first != nullptr && second != nullptr ? PyTuple_Pack(2, first, second)
                                                           : nullptr;
    Py_XDECREF(first);
    Py_XDECREF(second);
    return made;
}

int refuse(const char *why) {
    PyErr_Format(PyExc_TypeError, "a tensor the compiled loops cannot read: %s", why);
    return -1;
}

int fill_buffer(PyObject *object, Py_buffer *view, int flags) {
    const at::Tensor &tensor = THPVariable_Unpack(object);
    if (!tensor.defined() || !tensor.device().is_cpu() || tensor.layout() != c10::kStrided)
        return refuse("not a strided CPU tensor");
    if (tensor.is_conj() || tensor.is_neg()) return refuse("a lazily conjugated or negated view");
    const char *format = format_of(tensor.scalar_type());
    if (format == nullptr) return refuse("a dtype with no buffer format");
    const Py_ssize_t ndim = tensor.dim(), itemsize = tensor.element_size();
    /* Any layout only where strides are asked and no contiguity (PyBUF_C_CONTIGUOUS and the
     * like include PyBUF_STRIDES's bits): a tensor's view is then its strides as they are. */
    const int contiguity = PyBUF_C_CONTIGUOUS | PyBUF_F_CONTIGUOUS | PyBUF_ANY_CONTIGUOUS;
    const bool any_layout = (flags & PyBUF_STRIDES) == PyBUF_STRIDES &&
                            (flags & contiguity & ~PyBUF_STRIDES) == 0;
    if (!any_layout && !tensor.is_contiguous()) return refuse("not contiguous");
    void *data = tensor.data_ptr();  /* before the block: nothing to free where it throws */
    auto *block = static_cast<Py_ssize_t *>(PyMem_Malloc(sizeof(Py_ssize_t) * (2 * ndim + 1)));
    if (block == nullptr) {
        PyErr_NoMemory();
        return -1;
    }
    const auto sizes = tensor.sizes(), strides = tensor.strides();
    for (Py_ssize_t d = 0; d < ndim; d++) {
        block[d] = sizes[d];
        block[ndim + d] = strides[d] * itemsize;
    }
    static char empty;
    view->buf = data != nullptr ? data : &empty;
    view->obj = Py_NewRef(object);
    view->len = tensor.numel() * itemsize;
    view->itemsize = itemsize;
    view->readonly = 0;
    view->ndim = static_cast<int>(ndim);
    view->format = const_cast<char *>(format);
    view->shape = block;
    view->strides = block + ndim;
    view->suboffsets = nullptr;
    view->internal = block;
    return 1;
}

}  // namespace

extern "C" int tensor_buffer(PyObject *object, Py_buffer *view, int flags) {
    if (!is_tensor(object)) return 0;
    try {
        return fill_buffer(object, view, flags);
    } catch (const std::exception &error) { /* a tensor of no memory (a subclass's), say */
        return refuse(error.what());
    }
}

extern "C" int tensor_buffer_release(Py_buffer *view) {
    if (view->obj == nullptr || !is_tensor(view->obj)) return 0;
    PyMem_Free(view->internal);
    view->internal = nullptr;
    Py_CLEAR(view->obj);
    return 1;
}

/* ---- a frame's tensors (paramserver/wire/frames.py and bundles.py) ---- */

namespace {

/* A frame's name of a dtype it carries as data (frames.DTYPES), or nullptr. */
const char *frame_dtype_name(c10::ScalarType type) {
    switch (type) {
        case c10::ScalarType::Float: return "float32";
        case c10::ScalarType::Double: return "float64";
        case c10::ScalarType::Half: return "float16";
        case c10::ScalarType::BFloat16: return "bfloat16";
        case c10::ScalarType::Long: return "int64";
        case c10::ScalarType::Int: return "int32";
        case c10::ScalarType::Short: return "int16";
        case c10::ScalarType::Char: return "int8";
        case c10::ScalarType::Byte: return "uint8";
        case c10::ScalarType::Bool: return "bool";
        default: return nullptr;
    }
}

/* The name as one str object a dtype, as frames' own names are: the pickle then writes each
 * once a frame, as it does theirs (borrowed; nullptr with an error set where none is made). */
PyObject *interned_dtype_name(c10::ScalarType type) {
    static PyObject *names[static_cast<int>(c10::ScalarType::NumOptions)];
    PyObject *&name = names[static_cast<int>(type)];
    if (name == nullptr) name = PyUnicode_InternFromString(frame_dtype_name(type));
    return name;
}

/* Whether a frame carries `tensor` as data (frames._plain). */
bool frame_plain(const at::Tensor &tensor) {
    return frame_dtype_name(tensor.scalar_type()) != nullptr && tensor.device().is_cpu() &&
           tensor.layout() == c10::kStrided && !tensor.requires_grad() && !tensor.is_conj() &&
           !tensor.is_neg();
}

constexpr Py_ssize_t kAlign = 8; /* each small tensor's data starts at a multiple (frames._ALIGN) */

Py_ssize_t aligned(Py_ssize_t offset) { return (offset + kAlign - 1) / kAlign * kAlign; }

PyObject *shape_of(const at::Tensor &tensor) {
    const auto sizes = tensor.sizes();
    PyObject *shape = PyTuple_New(static_cast<Py_ssize_t>(sizes.size()));
    for (size_t d = 0; shape != nullptr && d < sizes.size(); d++) {
        PyObject *size = PyLong_FromLongLong(sizes[d]);
        if (size == nullptr) Py_CLEAR(shape);
        else PyTuple_SET_ITEM(shape, static_cast<Py_ssize_t>(d), size);
    }
    return shape;
}

/* Runs `body`, turning a C++ exception (torch's included) into a Python RuntimeError. */
template <typename Body>
PyObject *guarded(Body body) {
    try {
        return body();
    } catch (const std::exception &error) {
        PyErr_SetString(PyExc_RuntimeError, error.what());
        return nullptr;
    }
}

}  // namespace

extern "C" PyObject *frame_tensor(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyList_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "frame_tensor(small, large, small_fn, large_fn, large_bytes, obj)");
        return nullptr;
    }
    PyObject *small = args[0], *large = args[1], *object = args[5];
    if (!is_tensor(object)) Py_RETURN_NOTIMPLEMENTED;
    const Py_ssize_t large_bytes = PyLong_AsSsize_t(args[4]);
    if (large_bytes == -1 && PyErr_Occurred()) return nullptr;
    return guarded([&]() -> PyObject * {
        const at::Tensor &tensor = THPVariable_Unpack(object);
        if (!frame_plain(tensor)) Py_RETURN_NOTIMPLEMENTED;
        const Py_ssize_t nbytes = static_cast<Py_ssize_t>(tensor.nbytes());
        if (nbytes >= large_bytes) {
            /* Each large tensor its own storage exactly, so no more than its elements travel. */
            const bool whole = tensor.is_contiguous() &&
                               static_cast<Py_ssize_t>(tensor.storage().nbytes()) == nbytes;
            PyObject *travels =
                whole ? Py_NewRef(object)
                      : THPVariable_Wrap(tensor.clone(at::MemoryFormat::Contiguous));
            if (travels == nullptr) return nullptr;
            const int failed = PyList_Append(large, travels);
            Py_DECREF(travels);
            if (failed) return nullptr;
            return Py_BuildValue("O(n)", args[3], PyList_GET_SIZE(large) - 1);
        }
        if (PyList_Append(small, object)) return nullptr;
        PyObject *name = interned_dtype_name(tensor.scalar_type());
        PyObject *shape = name != nullptr ? shape_of(tensor) : nullptr;
        if (shape == nullptr) return nullptr;
        return Py_BuildValue("O(ON)", args[2], name, shape);
    });
}

extern "C" PyObject *small_data(PyObject *self, PyObject *args) {
    PyObject *frame_object, *small;
    Py_ssize_t at;
    if (!PyArg_ParseTuple(args, "OO!n", &frame_object, &PyList_Type, &small, &at)) return nullptr;
    Py_buffer frame = {};  /* None: measured only */
    if (frame_object != Py_None && PyObject_GetBuffer(frame_object, &frame, PyBUF_WRITABLE) < 0)
        return nullptr;
    PyObject *result = guarded([&]() -> PyObject * {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(small); i++) {
            PyObject *item = PyList_GET_ITEM(small, i);
            if (!is_tensor(item)) {
                PyErr_SetString(PyExc_TypeError, "small_data: a list of tensors is required");
                return nullptr;
            }
            const at::Tensor &tensor = THPVariable_Unpack(item);
            const Py_ssize_t nbytes = static_cast<Py_ssize_t>(tensor.nbytes());
            at = aligned(at);
            if (frame.obj != nullptr && nbytes) {
                if (at + nbytes > frame.len) {
                    PyErr_SetString(PyExc_ValueError, "small_data: the frame is too short");
                    return nullptr;
                }
                /* a view's elements in order, as its bytes travel */
                const at::Tensor contiguous = tensor.contiguous();
                memcpy(static_cast<char *>(frame.buf) + at, contiguous.data_ptr(), nbytes);
            }
            at += nbytes;
        }
        return PyLong_FromSsize_t(aligned(at));
    });
    if (frame.obj != nullptr) PyBuffer_Release(&frame);
    return result;
}

namespace {

/* Whether the tensors' shapes are equal past the first dimension, of one or more (bundles'
 * _one_width). */
bool one_width(PyObject *const *objects, Py_ssize_t count) {
    const at::Tensor &first = THPVariable_Unpack(objects[0]);
    const int64_t dims = first.dim();
    if (dims == 0) return false;
    for (Py_ssize_t i = 1; i < count; i++) {
        const at::Tensor &value = THPVariable_Unpack(objects[i]);
        if (value.dim() != dims || (dims > 1 && value.sizes().slice(1) != first.sizes().slice(1)))
            return false;
    }
    return true;
}

/* The tensor `objects` (count of them, one or more) make up end to end and in order, where
 * they fill one storage whole (bundles.joined_already), shaped as a bundle joins them; an
 * undefined tensor where they do not. */
at::Tensor joined_of(PyObject *const *objects, Py_ssize_t count) {
    if (!is_tensor(objects[0])) return {};
    const at::Tensor &first = THPVariable_Unpack(objects[0]);
    if (!first.device().is_cpu() || first.layout() != c10::kStrided) return {};
    const c10::Storage &storage = first.storage();
    const char *start = static_cast<const char *>(storage.data());
    const char *at = start;
    const c10::ScalarType type = first.scalar_type();
    const int64_t itemsize = static_cast<int64_t>(first.element_size());
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!is_tensor(objects[i])) return {};
        const at::Tensor &value = THPVariable_Unpack(objects[i]);
        if (value.scalar_type() != type || !value.is_contiguous()) return {};
        /* Each view must start where the last ended; that the last ends at the first one's
         * storage's end then proves every one inside that storage. */
        const int64_t numel = value.numel();
        if (numel) {
            if (static_cast<const char *>(value.data_ptr()) != at) return {};
            at += numel * itemsize;
        }
    }
    if (at != start + storage.nbytes()) return {};
    at::Tensor whole = at::empty({0}, first.options().requires_grad(false)).set_(storage);
    if (one_width(objects, count)) {
        std::vector<int64_t> shape(first.sizes().begin(), first.sizes().end());
        shape[0] = -1;
        whole = whole.view(shape);
    }
    return whole;
}

}  // namespace

extern "C" PyObject *joined_tensors(PyObject *self, PyObject *arg) {
    PyObject *items = PySequence_Fast(arg, "joined_tensors: a sequence of tensors is required");
    if (items == nullptr) return nullptr;
    PyObject *result = guarded([&]() -> PyObject * {
        const Py_ssize_t count = PySequence_Fast_GET_SIZE(items);
        if (count == 0) Py_RETURN_NONE;
        at::Tensor whole = joined_of(PySequence_Fast_ITEMS(items), count);
        if (!whole.defined()) Py_RETURN_NONE;
        return THPVariable_Wrap(std::move(whole));
    });
    Py_DECREF(items);
    return result;
}

extern "C" PyObject *bundle_values(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(args[0]) || PyList_GET_SIZE(args[0]) == 0) {
        PyErr_SetString(PyExc_TypeError, "bundle_values(values, threshold): a list of values");
        return nullptr;
    }
    PyObject *const *objects = PySequence_Fast_ITEMS(args[0]);
    const Py_ssize_t count = PyList_GET_SIZE(args[0]);
    const long long threshold = PyLong_AsLongLong(args[1]);
    if (threshold == -1 && PyErr_Occurred()) return nullptr;
    return guarded([&]() -> PyObject * {
        PyTypeObject *tensor_type = reinterpret_cast<PyTypeObject *>(THPVariableClass);
        long long nbytes = 0;
        bool one_dtype = true;
        for (Py_ssize_t i = 0; i < count; i++) {
            if (tensor_type == nullptr || Py_TYPE(objects[i]) != tensor_type) Py_RETURN_NONE;
            const at::Tensor &value = THPVariable_Unpack(objects[i]);
            if (value.layout() != c10::kStrided) Py_RETURN_NONE;
            nbytes += static_cast<long long>(value.nbytes());
            one_dtype &= value.scalar_type() == THPVariable_Unpack(objects[0]).scalar_type();
        }
        if (nbytes < threshold) Py_RETURN_NONE;
        if (!one_dtype) Py_RETURN_TRUE;
        at::Tensor flat = joined_of(objects, count);
        if (!flat.defined()) {
            c10::AutoGradMode no_grad(false);
            const bool rows = one_width(objects, count);
            std::vector<at::Tensor> parts;
            parts.reserve(count);
            for (Py_ssize_t i = 0; i < count; i++) {
                const at::Tensor &value = THPVariable_Unpack(objects[i]);
                parts.push_back(rows ? value : value.reshape({-1}));
            }
            flat = at::cat(parts);
        }
        if (!flat.device().is_cpu() || flat.layout() != c10::kStrided || flat.requires_grad() ||
            flat.is_quantized())
            Py_RETURN_NONE;
        PyObject *shapes = PyTuple_New(count);
        for (Py_ssize_t i = 0; shapes != nullptr && i < count; i++) {
            PyObject *shape = shape_of(THPVariable_Unpack(objects[i]));
            if (shape == nullptr) Py_CLEAR(shapes);
            else PyTuple_SET_ITEM(shapes, i, shape);
        }
        PyObject *wrapped = shapes != nullptr ? THPVariable_Wrap(std::move(flat)) : nullptr;
        return pair(shapes, wrapped);
    });
}

namespace {

/* The dtype a frame names `name` (frames.DTYPES' names), or Undefined. */
c10::ScalarType frame_dtype_of(PyObject *name) {
    static const c10::ScalarType types[] = {
        c10::ScalarType::Float, c10::ScalarType::Double, c10::ScalarType::Half,
        c10::ScalarType::BFloat16, c10::ScalarType::Long, c10::ScalarType::Int,
        c10::ScalarType::Short, c10::ScalarType::Char, c10::ScalarType::Byte,
        c10::ScalarType::Bool};
    if (!PyUnicode_Check(name)) return c10::ScalarType::Undefined;
    for (c10::ScalarType type : types)
        if (PyUnicode_CompareWithASCIIString(name, frame_dtype_name(type)) == 0) return type;
    return c10::ScalarType::Undefined;
}

}  // namespace

extern "C" PyObject *frame_small_tensor(PyObject *self, PyObject *args) {
    PyObject *data_object, *name, *shape_object;
    Py_ssize_t at;
    if (!PyArg_ParseTuple(args, "OnOO", &data_object, &at, &name, &shape_object)) return nullptr;
    const c10::ScalarType type = frame_dtype_of(name);
    if (type == c10::ScalarType::Undefined) return PyUnicode_FromString("unknown dtype");
    if (!PyTuple_Check(shape_object))
        return PyUnicode_FromString("a frame's tensor shape is not a tuple of sizes");
    Py_buffer data;
    if (PyObject_GetBuffer(data_object, &data, PyBUF_WRITABLE) < 0) return nullptr;
    PyObject *result = guarded([&]() -> PyObject * {
        const Py_ssize_t dims = PyTuple_GET_SIZE(shape_object);
        std::vector<int64_t> shape(static_cast<size_t>(dims));
        const int64_t itemsize = static_cast<int64_t>(c10::elementSize(type));
        const Py_ssize_t start = aligned(at);
        const char *too_much = "a frame's tensors claim more data than it holds";
        bool absurd = false; /* a size past int64: more than any frame holds */
        for (Py_ssize_t d = 0; d < dims; d++) {
            PyObject *size = PyTuple_GET_ITEM(shape_object, d);
            int overflow = 0;
            const long long value =
                PyLong_CheckExact(size) ? PyLong_AsLongLongAndOverflow(size, &overflow) : -1;
            if ((value < 0 && overflow <= 0) || overflow < 0)
                return PyUnicode_FromString("a frame's tensor shape is not a tuple of sizes");
            absurd = absurd || overflow > 0;
            shape[static_cast<size_t>(d)] = value;
        }
        if (absurd) return PyUnicode_FromString(too_much);
        /* Multiplied out as far as it stays within the data (frames._small_tensor_by_numpy
         * stops there too), so no product overflows; a size of 0 holds none whatever the rest. */
        int64_t numel = std::find(shape.begin(), shape.end(), 0) != shape.end() ? 0 : 1;
        for (int64_t size : shape) {
            if (numel == 0) break;
            if (numel > data.len / size) return PyUnicode_FromString(too_much);
            numel *= size;
        }
        if (start + numel * itemsize > data.len) return PyUnicode_FromString(too_much);
        const Py_ssize_t end = start + static_cast<Py_ssize_t>(numel * itemsize);
        const auto options = at::TensorOptions().dtype(type);
        at::Tensor tensor;
        if (numel == 0) {
            tensor = at::empty(shape, options);
        } else {
            /* A view of the frame's data, which the tensor keeps (torch.from_numpy's way). */
            PyObject *owner = Py_NewRef(data_object);
            tensor = at::from_blob(
                static_cast<char *>(data.buf) + start, shape,
                [owner](void *) {
                    PyGILState_STATE state = PyGILState_Ensure();
                    Py_DECREF(owner);
                    PyGILState_Release(state);
                },
                options);
        }
        PyObject *made = THPVariable_Wrap(std::move(tensor));
        if (made == nullptr) return nullptr;
        return Py_BuildValue("Nn", made, end);
    });
    PyBuffer_Release(&data);
    return result;
}

extern "C" PyObject *are_rows(PyObject *self, PyObject *args) {
    PyObject *tensors;
    int float64_too;
    if (!PyArg_ParseTuple(args, "O!p", &PyTuple_Type, &tensors, &float64_too)) return nullptr;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tensors); i++) {
        PyObject *item = PyTuple_GET_ITEM(tensors, i);
        if (!is_tensor(item)) Py_RETURN_FALSE;
        const at::Tensor &tensor = THPVariable_Unpack(item);
        const c10::ScalarType type = tensor.scalar_type();
        const bool typed = type == c10::ScalarType::Float ||
                           (float64_too && type == c10::ScalarType::Double);
        if (!typed || tensor.dim() != 2 || !tensor.device().is_cpu() ||
            tensor.layout() != c10::kStrided || !tensor.is_contiguous())
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* ---- a message's tensor data, as sent and uncompressed (paramserver/wire/sizing.py) ---- */

namespace {

/* What payload_sizes needs besides the message: types it hands to a function of their own,
 * the function naming a dataclass's fields, and collections.abc.Mapping. */
struct SizesWalk {
    PyObject *special;      /* {type: function(object) -> (sent, uncompressed)} */
    PyObject *field_names;  /* function(dataclass type) -> tuple of field names */
    PyObject *mapping;      /* collections.abc.Mapping */
    long long sent = 0, uncompressed = 0;
    bool overflowed = false; /* a count past int64: the caller counts in Python instead */

    void add(long long more_sent, long long more_uncompressed) {
        overflowed |= __builtin_add_overflow(sent, more_sent, &sent) ||
                      __builtin_add_overflow(uncompressed, more_uncompressed, &uncompressed);
    }

    /* Adds `object`'s sizes; -1 with an error set where it cannot be walked. */
    int walk(PyObject *object) {
        PyTypeObject *type = Py_TYPE(object);
        if (object == Py_None || type == &PyLong_Type || type == &PyFloat_Type ||
            type == &PyBool_Type || type == &PyUnicode_Type || type == &PyBytes_Type)
            return 0;
        if (is_tensor(object)) {
            const long long nbytes = static_cast<long long>(THPVariable_Unpack(object).nbytes());
            add(nbytes, nbytes);
            return 0;
        }
        PyObject *function = PyDict_GetItemWithError(special, reinterpret_cast<PyObject *>(type));
        if (function != nullptr) return add_special(function, object);
        if (PyErr_Occurred()) return -1;
        if (Py_EnterRecursiveCall(" while measuring a message")) return -1;
        const int walked = walk_parts(object, type);
        Py_LeaveRecursiveCall();
        return walked;
    }

    int add_special(PyObject *function, PyObject *object) {
        PyObject *sizes = PyObject_CallOneArg(function, object);
        if (sizes == nullptr) return -1;
        long long more_sent = 0, more_uncompressed = 0;
        const bool read = PyTuple_Check(sizes) && PyTuple_GET_SIZE(sizes) == 2 &&
                          read_count(PyTuple_GET_ITEM(sizes, 0), &more_sent) &&
                          read_count(PyTuple_GET_ITEM(sizes, 1), &more_uncompressed);
        Py_DECREF(sizes);
        if (PyErr_Occurred()) return -1;
        if (!read) {
            PyErr_SetString(PyExc_TypeError, "payload_sizes: a size function returned no pair");
            return -1;
        }
        add(more_sent, more_uncompressed);
        return 0;
    }

    /* Reads a count into `count`; one past int64 marks the walk overflowed. */
    bool read_count(PyObject *value, long long *count) {
        int past = 0;
        *count = PyLong_Check(value) ? PyLong_AsLongLongAndOverflow(value, &past) : -1;
        overflowed |= past != 0;
        return PyLong_Check(value) && !(*count == -1 && PyErr_Occurred());
    }

    int walk_parts(PyObject *object, PyTypeObject *type) {
        if (PyDict_Check(object)) {
            PyObject *key, *value;
            Py_ssize_t at = 0;
            while (PyDict_Next(object, &at, &key, &value)) {
                Py_INCREF(value); /* held while walked: a size function may change the dict */
                const int walked = walk(value);
                Py_DECREF(value);
                if (walked < 0) return -1;
            }
            return 0;
        }
        if (PyList_Check(object) || PyTuple_Check(object)) {
            /* a list's items held while walked: a size function may change the list */
            PyObject *items = PySequence_Fast(object, "");
            if (items == nullptr) return -1;
            int walked = 0;
            for (Py_ssize_t i = 0; walked == 0 && i < PySequence_Fast_GET_SIZE(items); i++)
                walked = walk(PySequence_Fast_GET_ITEM(items, i));
            Py_DECREF(items);
            return walked;
        }
        static PyObject *dataclass_fields = PyUnicode_InternFromString("__dataclass_fields__");
        if (dataclass_fields == nullptr) return -1;
        /* dataclasses.is_dataclass of an instance: its type has the attribute */
        if (!PyType_Check(object) && _PyType_Lookup(type, dataclass_fields) != nullptr)
            return walk_fields(object, type);
        const int is_mapping = PyObject_IsInstance(object, mapping);
        if (is_mapping <= 0) return is_mapping;
        PyObject *values = PyMapping_Values(object);
        if (values == nullptr) return -1;
        const int walked = walk(values);
        Py_DECREF(values);
        return walked;
    }

    int walk_fields(PyObject *object, PyTypeObject *type) {
        PyObject *names = PyObject_CallOneArg(field_names, reinterpret_cast<PyObject *>(type));
        if (names == nullptr) return -1;
        if (!PyTuple_Check(names)) {
            Py_DECREF(names);
            PyErr_SetString(PyExc_TypeError, "payload_sizes: field names must be a tuple");
            return -1;
        }
        int walked = 0;
        for (Py_ssize_t i = 0; walked == 0 && i < PyTuple_GET_SIZE(names); i++) {
            PyObject *value = PyObject_GetAttr(object, PyTuple_GET_ITEM(names, i));
            walked = value == nullptr ? -1 : walk(value);
            Py_XDECREF(value);
        }
        Py_DECREF(names);
        return walked;
    }
};

}  // namespace

extern "C" PyObject *payload_sizes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyDict_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError,
                        "payload_sizes(special, field_names, mapping, message)");
        return nullptr;
    }
    SizesWalk sizes{args[0], args[1], args[2]};
    PyObject *result = guarded([&]() -> PyObject * {
        if (sizes.walk(args[3]) < 0) return nullptr;
        if (sizes.overflowed) Py_RETURN_NONE;
        return Py_BuildValue("LL", sizes.sent, sizes.uncompressed);
    });
    return result;
}

/* ---- a record pass's unique ids (paramserver/trainer/lookups.py) ---- */

namespace {

/* Whether unique_lookups reads `tensor` as a lookup's ids. */
bool lookup_ids(const at::Tensor &tensor) {
    const auto type = tensor.scalar_type();
    return tensor.defined() && tensor.dim() == 1 && tensor.device().is_cpu() &&
           tensor.layout() == c10::kStrided &&
           (type == c10::ScalarType::Long || type == c10::ScalarType::Int);
}

}  // namespace

extern "C" PyObject *unique_lookups(PyObject *self, PyObject *groups) {
    if (!PyList_Check(groups)) {
        PyErr_SetString(PyExc_TypeError, "unique_lookups: a list of lists of tensors is required");
        return nullptr;
    }
    const Py_ssize_t num_tables = PyList_GET_SIZE(groups);
    Py_ssize_t total = 0, largest = 0;
    for (Py_ssize_t t = 0; t < num_tables; t++) {
        PyObject *lookups = PyList_GET_ITEM(groups, t);
        if (!PyList_Check(lookups)) {
            PyErr_SetString(PyExc_TypeError, "unique_lookups: a list of lists of tensors is required");
            return nullptr;
        }
        Py_ssize_t size = 0;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(lookups); i++) {
            PyObject *item = PyList_GET_ITEM(lookups, i);
            if (!is_tensor(item) || !lookup_ids(THPVariable_Unpack(item))) Py_RETURN_NONE;
            size += THPVariable_Unpack(item).numel();
        }
        total += size;
        largest = std::max(largest, size);
    }
    return guarded([&]() -> PyObject * {
        /* joined ids, then unique ids, then positions: each table's from where its ids start */
        const at::Tensor buffer = at::empty({3 * total}, at::kLong);
        int64_t *joined = buffer.data_ptr<int64_t>(), *unique = joined + total,
                *inverse = unique + total;
        std::vector<char> workspace(unique_workspace_bytes(largest));
        PyObject *found = PyList_New(num_tables);
        Py_ssize_t start = 0;
        for (Py_ssize_t t = 0; found != nullptr && t < num_tables; t++) {
            PyObject *lookups = PyList_GET_ITEM(groups, t);
            const Py_ssize_t count = PyList_GET_SIZE(lookups);
            Py_ssize_t at = start;
            for (Py_ssize_t i = 0; i < count; i++) {
                const at::Tensor &ids = THPVariable_Unpack(PyList_GET_ITEM(lookups, i));
                const Py_ssize_t n = ids.numel();
                if (n == 0) continue;
                if (ids.scalar_type() == c10::ScalarType::Long && ids.is_contiguous())
                    memcpy(joined + at, ids.data_ptr<int64_t>(), n * sizeof(int64_t));
                else
                    buffer.narrow(0, at, n).copy_(ids);
                at += n;
            }
            const Py_ssize_t num_unique = unique_ids(joined + start, at - start, workspace.data(),
                                                     unique + start, inverse + start);
            PyObject *each = PyList_New(count);
            at = start;
            for (Py_ssize_t i = 0; each != nullptr && i < count; i++) {
                const Py_ssize_t n = THPVariable_Unpack(PyList_GET_ITEM(lookups, i)).numel();
                PyObject *made = pair(THPVariable_Wrap(buffer.narrow(0, at, n)),
                                      THPVariable_Wrap(buffer.narrow(0, 2 * total + at, n)));
                if (made == nullptr) Py_CLEAR(each);
                else PyList_SET_ITEM(each, i, made);
                at += n;
            }
            PyObject *table =
                each != nullptr ? pair(THPVariable_Wrap(buffer.narrow(0, total + start, num_unique)), each)
                                : nullptr;
            if (table == nullptr) Py_CLEAR(found);
            else PyList_SET_ITEM(found, t, table);
            start = at;
        }
        return found;
    });
}

/* ---- a bundle's views (paramserver/wire/bundles.py's unbundled) ---- */

namespace {

constexpr const char *kNames = "a bundle's names must be a tuple of strings";
constexpr const char *kTwice = "a bundle names a tensor twice";
constexpr const char *kFlat = "a bundle's values must be one plain tensor of 1 or more dimensions";
constexpr const char *kOneShape = "a bundle must give one shape per name";
constexpr const char *kSizes = "a bundle's shapes must be tuples of sizes";
constexpr const char *kClaimsMore = "a bundle's shapes claim more values than it holds";
constexpr const char *kHoldsMore = "a bundle holds more values than its shapes claim";

/* A size of a peer's shape, once bundle_problem found it an int64 (a tensor's sizes are). */
int64_t claimed_size(PyObject *size) { return static_cast<int64_t>(PyLong_AsLongLong(size)); }

/* Whether every one of `items` (a tuple) is exactly of `type`. */
bool all_of(PyObject *items, PyTypeObject *type) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); i++)
        if (Py_TYPE(PyTuple_GET_ITEM(items, i)) != type) return false;
    return true;
}

/* Whether every shape (of int64 sizes) is the rows of `flat` (bundles._as_rows): one or more
 * sizes, all but the first those of flat's rows. */
bool as_rows(const at::Tensor &flat, PyObject *shapes) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shapes); i++) {
        PyObject *shape = PyTuple_GET_ITEM(shapes, i);
        const Py_ssize_t dims = PyTuple_GET_SIZE(shape);
        if (dims == 0 || dims != flat.dim()) return false;
        for (Py_ssize_t d = 1; d < dims; d++)
            if (claimed_size(PyTuple_GET_ITEM(shape, d)) != flat.size(d)) return false;
    }
    return true;
}

/* What is wrong with a bundle (bundles._bundle_problem's words), or nullptr. Its shapes are
 * multiplied out as that does, stopping once a claim passes what the flat tensor holds. */
const char *bundle_problem(PyObject *names, PyObject *shapes, PyObject *flat_object) {
    if (!PyTuple_CheckExact(names) || !all_of(names, &PyUnicode_Type)) return kNames;
    PyObject *distinct = PySet_New(names);
    if (distinct == nullptr) return nullptr; /* an error set: the caller sees it */
    const bool twice = PySet_GET_SIZE(distinct) != PyTuple_GET_SIZE(names);
    Py_DECREF(distinct);
    if (twice) return kTwice;
    if (THPVariableClass == nullptr ||
        Py_TYPE(flat_object) != reinterpret_cast<PyTypeObject *>(THPVariableClass))
        return kFlat;
    const at::Tensor &flat = THPVariable_Unpack(flat_object);
    if (flat.dim() == 0 || !flat.device().is_cpu() || flat.layout() != c10::kStrided ||
        flat.requires_grad() || flat.is_quantized())
        return kFlat;
    if (!PyTuple_CheckExact(shapes) || PyTuple_GET_SIZE(shapes) != PyTuple_GET_SIZE(names))
        return kOneShape;
    if (!all_of(shapes, &PyTuple_Type)) return kSizes;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shapes); i++) {
        PyObject *shape = PyTuple_GET_ITEM(shapes, i);
        if (!all_of(shape, &PyLong_Type)) return kSizes;
        for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(shape); d++) {
            int past = 0;
            const long long size = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(shape, d), &past);
            if (past != 0 || size < 0) return kSizes; /* (bundles._LARGEST_SIZE) */
        }
    }
    if (as_rows(flat, shapes)) {
        int64_t rows = 0;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shapes); i++) {
            const int64_t count = claimed_size(PyTuple_GET_ITEM(PyTuple_GET_ITEM(shapes, i), 0));
            if (__builtin_add_overflow(rows, count, &rows)) return kClaimsMore;
        }
        if (rows > flat.size(0)) return kClaimsMore;
        return rows < flat.size(0) ? kHoldsMore : nullptr;
    }
    int64_t remaining = flat.numel();
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shapes); i++) {
        PyObject *shape = PyTuple_GET_ITEM(shapes, i);
        int64_t size = 1;
        for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(shape); d++) {
            const int64_t dim = claimed_size(PyTuple_GET_ITEM(shape, d));
            /* a product past int64 claims more than any tensor holds */
            if (__builtin_mul_overflow(size, dim, &size)) return kClaimsMore;
            if (size > remaining) return kClaimsMore;
        }
        remaining -= size;
    }
    return remaining ? kHoldsMore : nullptr;
}

}  // namespace

extern "C" PyObject *unbundled_views(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "unbundled_views(names, shapes, flat)");
        return nullptr;
    }
    PyObject *names = args[0], *shapes = args[1];
    return guarded([&]() -> PyObject * {
        const char *problem = bundle_problem(names, shapes, args[2]);
        if (problem != nullptr) return PyUnicode_FromString(problem);
        if (PyErr_Occurred()) return nullptr;
        const at::Tensor &given = THPVariable_Unpack(args[2]);
        const bool rows = as_rows(given, shapes);
        const at::Tensor flat = rows ? given : given.reshape({-1});
        PyObject *views = PyDict_New();
        int64_t at = 0;
        for (Py_ssize_t i = 0; views != nullptr && i < PyTuple_GET_SIZE(shapes); i++) {
            PyObject *shape = PyTuple_GET_ITEM(shapes, i);
            std::vector<int64_t> sizes(PyTuple_GET_SIZE(shape));
            int64_t numel = 1;
            for (size_t d = 0; d < sizes.size(); d++) {
                sizes[d] = claimed_size(PyTuple_GET_ITEM(shape, d));
                numel *= sizes[d]; /* checked above: within what flat holds */
            }
            const int64_t length = rows ? sizes[0] : numel;
            at::Tensor part = flat.narrow(0, at, length);
            if (!rows) part = part.view(sizes);
            at += length;
            PyObject *view = THPVariable_Wrap(std::move(part));
            if (view == nullptr || PyDict_SetItem(views, PyTuple_GET_ITEM(names, i), view) < 0)
                Py_CLEAR(views);
            Py_XDECREF(view);
        }
        return views;
    });
}
