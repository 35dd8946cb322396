/* A torch tensor's memory as a Py_buffer (see _tensor_buffer.h). Compiled only where torch's
 * headers are there to build with (setup.py); the view holds a reference to the tensor, and
 * its shape and strides (in bytes) in one block of its own, freed at release. */
#include <Python.h>
/* torch's headers use C++20's bit-field initializers, which g++ takes in C++17 with a warning. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wc++20-extensions"
#include <torch/csrc/autograd/python_variable.h>
#pragma GCC diagnostic pop

#include "_tensor_buffer.h"

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

int refuse(const char *why) {
    PyErr_Format(PyExc_TypeError, "a tensor the compiled loops cannot read: %s", why);
    return -1;
}

}  // namespace

extern "C" int tensor_buffer(PyObject *object, Py_buffer *view, int flags) {
    if (!is_tensor(object)) return 0;
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
    void *data = tensor.data_ptr();
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

extern "C" int tensor_buffer_release(Py_buffer *view) {
    if (view->obj == nullptr || !is_tensor(view->obj)) return 0;
    PyMem_Free(view->internal);
    view->internal = nullptr;
    Py_CLEAR(view->obj);
    return 1;
}
