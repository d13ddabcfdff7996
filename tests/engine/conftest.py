from __future__ import annotations

import pytest

from pdmesh.services.engine.models import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model("tiny")


@pytest.fixture(params=["native", "torch"])
def attention_path(request, monkeypatch) -> str:
    """Run a test with decode attention in the native kernel (services/engine/native.py)
    and again in torch: both must keep every invariance the test checks."""
    from pdmesh.services.engine import native

    if request.param == "native":
        if native.setting() == "off":
            pytest.skip("PDMESH_NATIVE_ATTENTION=off")
        assert native.available(), "the native decode attention did not build here"
    else:
        monkeypatch.setattr(native, "usable", lambda device, dtype: False)
    return request.param
