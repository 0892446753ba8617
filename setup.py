"""The parts of kvconn that are compiled: kvconn/_scatter.c and kvconn/_checksum.c (see
their headers for why).

Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvconn._scatter", ["kvconn/_scatter.c"], extra_compile_args=["-O2"]),
        # dlopen lives in libc from glibc 2.34, in libdl before it
        Extension(
            "kvconn._checksum",
            ["kvconn/_checksum.c"],
            extra_compile_args=["-O2"],
            libraries=["dl"],
        ),
    ]
)
