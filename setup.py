"""The one build step pyproject.toml cannot declare without an experimental table: compiling
paramserver's C loops (paramserver/native.py says what they do). The extension is optional:
without a C compiler the install still succeeds, and the same operations run in numpy."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "paramserver._native",
            sources=["paramserver/_native.c"],
            # No fused multiply-add, as in torch's loops: results stay bitwise torch's.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"],
            optional=True,
        )
    ]
)
