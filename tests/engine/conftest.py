from __future__ import annotations

import pytest

from pdmesh.services.engine.models import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model("tiny")
