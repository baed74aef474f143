"""The C++ kernels build wherever a compiler is: the kernel tests skip when they cannot be
built, so a source that stopped compiling would otherwise pass the suite unnoticed."""

from __future__ import annotations

import os
import platform
import shutil

import pytest

from jaxinfer.layers import cpu_kernels


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64"
                    or not any(shutil.which(c) for c in ("g++", "c++", "clang++"))
                    or os.environ.get("JAXINFER_CPU_ATTENTION", "1").strip() == "0",
                    reason="the kernels are built for x86-64 Linux with a C++ compiler (and on)")
def test_kernels_build_and_load_where_a_compiler_is():
    cpu_kernels.build()  # raises with the compiler's error output
    assert cpu_kernels.available()
