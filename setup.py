"""The one build step pyproject.toml cannot declare without an experimental table: compiling
paramserver's C loops (paramserver/native.py says what they do). The extension is optional:
without a C and a C++ compiler the install still succeeds, and the same operations run in numpy
(or torch). One source is C++ (``_sort_order.cpp``) only to call the C++ library's std::sort,
whose order among equal keys is the one torch's sort gives; the extension links as C++.

Where torch is importable as the extension builds (``pip install --no-build-isolation``, as the
Makefile installs), the loops also take torch tensors as they are (``_tensors.cpp``, built
with torch's headers and linked to its libraries): ``Tensor.numpy()`` costs thousands of
instructions a call, which a step pays for each of its tables' tensors. Built so, the module
loads only beside the torch release it was built with (native.py checks)."""

from setuptools import Extension, setup


def _with_torch() -> dict[str, list]:
    """The extension's arguments for tensors, where torch is there to build with."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return {}
    version = torch.__version__
    return {
        "sources": ["paramserver/_tensors.cpp"],
        "include_dirs": cpp_extension.include_paths(),
        "library_dirs": cpp_extension.library_paths(),
        "runtime_library_dirs": cpp_extension.library_paths(),
        "libraries": ["c10", "torch", "torch_cpu", "torch_python"],
        "define_macros": [("PARAMSERVER_TENSORS", f'"{version}"')],
    }


torch_parts = _with_torch()
setup(
    ext_modules=[
        Extension(
            "paramserver._native",
            sources=[
                "paramserver/_native.c",
                "paramserver/_sort_order.cpp",
                *torch_parts.get("sources", []),
            ],
            depends=["paramserver/_sort_order.h", "paramserver/_tensors.h"],
            include_dirs=torch_parts.get("include_dirs", []),
            library_dirs=torch_parts.get("library_dirs", []),
            runtime_library_dirs=torch_parts.get("runtime_library_dirs", []),
            libraries=torch_parts.get("libraries", []),
            define_macros=torch_parts.get("define_macros", []),
            # A multiply-add is fused only where the C asks for it (fmaf): optim.py
            # picks the rounding that gives torch's results on the machine.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"],
            optional=True,
        )
    ]
)
