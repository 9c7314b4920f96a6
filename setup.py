"""Only the optional compiled staging helper lives here; everything else is in pyproject.toml.

`optional=True`: where no C compiler or Python headers exist, the install goes on without it and staging runs its
exact Python twins (same results, slower; graph mode then reports that it needs the helper).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "multiwrite.staging._cstaging",
            # One module from eleven files (multiwrite/staging/_cstaging.h says what holds what).
            [
                "multiwrite/staging/_cstaging.c",
                "multiwrite/staging/_cstaging_arena.c",
                "multiwrite/staging/_cstaging_block_ids.c",
                "multiwrite/staging/_cstaging_headers.c",
                "multiwrite/staging/_cstaging_vllm.c",
                "multiwrite/staging/_cstaging_launch.c",
                "multiwrite/staging/_cstaging_driver.c",
                "multiwrite/staging/_cstaging_grid.c",
                "multiwrite/staging/_cstaging_stage.c",
                "multiwrite/staging/_cstaging_prepare.c",
                "multiwrite/staging/_cstaging_entry.c",
                "multiwrite/staging/_cstaging_commit.c",
            ],
            depends=["multiwrite/staging/_cstaging.h", "multiwrite/staging/_cstaging_entry.h",
                     "multiwrite/staging/_cstaging_grid.h"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-missing-field-initializers", "-Wno-unused-parameter"],
        )
    ]
)
