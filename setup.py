"""Build configuration beyond pyproject.toml: the timing engine's walk in C
(schedules/_engine.c, the only copy of the engine's rules that runs in product code).
It is optional: an install without a C compiler goes on, and the engine then runs the
SimPy model of the same rules (schedules/engine_reference.py), the specification the C walk
is tested against."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("schedules._engine", ["schedules/_engine.c"], optional=True, extra_compile_args=["-O2"]),
])
