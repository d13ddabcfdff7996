"""The isolation suite runs on the shared live mesh and checks pool accounting after each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.isolation.meshstats import assert_pools_clean
from tests.meshproc import Mesh


@pytest.fixture
def mesh(live_mesh: Mesh) -> Iterator[Mesh]:
    """The live mesh; after the test every lease is back and every pool passes integrity."""
    yield live_mesh
    assert_pools_clean(live_mesh.nats_url)
