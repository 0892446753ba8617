"""The one part of kvconn that is compiled: kvconn/_scatter.c (see its header for why).

Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvconn._scatter", ["kvconn/_scatter.c"], extra_compile_args=["-O2"]),
    ]
)
