"""The one build step pyproject.toml cannot declare without an experimental table: compiling
paramserver's C loops (paramserver/native.py says what they do). The extension is optional:
without a C and a C++ compiler the install still succeeds, and the same operations run in numpy
(or torch). One source is C++ (``_sort_order.cpp``) only to call the C++ library's std::sort,
whose order among equal keys is the one torch's sort gives; the extension links as C++."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "paramserver._native",
            sources=["paramserver/_native.c", "paramserver/_sort_order.cpp"],
            depends=["paramserver/_sort_order.h"],
            # A multiply-add is fused only where the C asks for it (fmaf): optim.py
            # picks the rounding that gives torch's results on the machine.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"],
            optional=True,
        )
    ]
)
