"""Build configuration beyond pyproject.toml: optional C loops, the direct rendezvous
engine's (pipesim/sim/_rendezvous.c), the time accounting's (schedules/_accounting.c),
lowering's (schedules/_lowering.c) and zb-auto's timing (schedules/_timing.c). Each
has a Python twin it is tested equal to; with ``optional=True`` an install without a C
compiler goes on and runs those. native/pipesim_native.h holds what they share."""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension(name, [source], optional=True, extra_compile_args=["-O2"], include_dirs=["native"],
              depends=["native/pipesim_native.h"])
    for name, source in (("pipesim._rendezvous", "pipesim/sim/_rendezvous.c"),
                         ("schedules._accounting", "schedules/_accounting.c"),
                         ("schedules._lowering", "schedules/_lowering.c"),
                         ("schedules._timing", "schedules/_timing.c"))
])
