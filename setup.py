"""Only the optional compiled staging path lives here; everything else is in pyproject.toml.

`optional=True`: where no C compiler or Python headers exist, the install goes on without it and
BlockTables stages through its pure-Python path (same results, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("multiwrite._cstaging", ["multiwrite/_cstaging.c"], optional=True, extra_compile_args=["-O2"])
    ]
)
