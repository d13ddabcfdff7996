"""Which NIXL build this process can import, without importing it.

PyPI ships NIXL as one wheel per CUDA major, each under its own module name and with the
same API: `nixl-cu12` (`import nixl_cu12`, next to the CPU torch and CUDA 12 builds) and
`nixl-cu13` (`import nixl_cu13`, next to a CUDA 13 torch, PyPI's default on newer
Pythons). pyproject.toml's extras `nixl` and `nixl-cu13` install one; the Makefile picks
the one that matches torch. The nixl transport and the tests that need NIXL ask this
module which one is there.
"""

from __future__ import annotations

import importlib.util

# In order of preference: the CUDA 12 build first, so that an install that has it keeps
# the module it imported before the CUDA 13 build was supported.
NIXL_MODULES = ("nixl_cu12", "nixl_cu13")
INSTALL_HINT = "pip install 'pdmesh[nixl]' (CUDA 12 / CPU torch) or 'pdmesh[nixl-cu13]'"


def nixl_module() -> str | None:
    """The name of the first NIXL module of `NIXL_MODULES` that is installed, or None.
    Only looked up: importing NIXL loads its libraries (UCX, its plugins)."""
    for name in NIXL_MODULES:
        if importlib.util.find_spec(name) is not None:
            return name
    return None
