"""The isolation suite runs on the shared live mesh and checks pool accounting after each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.meshproc import Mesh
from tests.support.meshstats import assert_pools_clean


@pytest.fixture
def mesh(live_mesh: Mesh) -> Iterator[Mesh]:
    """The live mesh; after the test every lease is back and every pool passes integrity."""
    yield live_mesh
    assert_pools_clean(live_mesh.nats_url)
