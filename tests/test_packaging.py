"""Packaging: every package folder is installed under the one `pdmesh.` namespace."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_installed_under_pdmesh() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setuptools["package-dir"]
    assert all(name.startswith("pdmesh.") for name in package_dir)
    on_disk = set()
    for name, folder in package_dir.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            on_disk.add(".".join([name, *rel.parts]))
    assert on_disk == set(setuptools["packages"]), (
        "pyproject.toml [tool.setuptools] packages must list every package folder: "
        f"missing {sorted(on_disk - set(setuptools['packages']))}, "
        f"extra {sorted(set(setuptools['packages']) - on_disk)}")
    assert "py-modules" not in setuptools  # no top-level module besides the namespace
