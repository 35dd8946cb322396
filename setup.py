"""The one build step pyproject.toml cannot declare without an experimental table: compiling
paramserver's C loops (paramserver/native.py says what they do). The extension is optional:
without a C compiler the install still succeeds, and the same operations run in numpy."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "paramserver._native",
            sources=["paramserver/_native.c"],
            # A multiply-add is fused only where the C asks for it (fmaf): optim.py
            # picks the rounding that gives torch's results on the machine.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"],
            optional=True,
        )
    ]
)
