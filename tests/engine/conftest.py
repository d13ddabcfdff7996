from __future__ import annotations

import pytest

from pdmesh.services.engine.models import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model("tiny")


@pytest.fixture(params=["native", "torch"])
def attention_path(request, monkeypatch) -> str:
    """Run a test with decode in the native kernels (attention and matmuls,
    services/engine/native.py) and again in torch: both must keep every invariance the
    test checks."""
    from pdmesh.services.engine import native

    if request.param == "native":
        if native.setting() == "off":
            pytest.skip("PDMESH_NATIVE_KERNELS=off")
        assert native.available(), "the native decode kernels did not build here"
    else:
        monkeypatch.setattr(native, "usable", lambda device, dtype: False)
    return request.param
