"""The multi-host lab as a fixture, once per transport (TCP, then UCX).

Runs only under `make test-multihost` (PDMESH_MULTIHOST=1): it needs root to create network
namespaces and takes a few minutes. Where namespaces cannot be created the target says so
loudly and skips (see the Makefile).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

from tests.support.lab import SERVICES, Lab
from tests.support.netns import probe

ENABLED = os.environ.get("PDMESH_MULTIHOST") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="multi-host lab (root, network namespaces): "
                                   "run `make test-multihost`")
    for item in items:
        if "tests/multihost/" in item.nodeid and {"lab", "mesh"} & set(item.fixturenames):
            item.add_marker(pytest.mark.multihost)
            item.add_marker(pytest.mark.mesh)
            if not ENABLED:
                item.add_marker(skip)


@pytest.fixture(scope="module", params=["tcp", "ucx"])
def lab(request: pytest.FixtureRequest) -> Iterator[Lab]:
    if request.param == "ucx" and importlib.util.find_spec("ucxx") is None:
        pytest.skip("ucxx is not importable")
    why = probe()
    if why:
        pytest.fail(f"network namespaces cannot be created here: {why}")
    lab = Lab(request.param)
    try:
        lab.start()
    except BaseException:
        print(lab.logs())
        lab.stop()
        raise
    try:
        yield lab
    finally:
        lab.stop()
    # The run's protocol trace, every process of every host, against the model's rules.
    assert lab.trace_files >= len(SERVICES), f"only {lab.trace_files} processes traced"
    assert not lab.trace_violations, "\n".join(str(v) for v in lab.trace_violations[:20])


@pytest.fixture
def mesh(lab: Lab) -> Iterator[Lab]:
    """The lab; on failure the services' last log lines are printed."""
    yield lab
    lab.assert_pools_clean(timeout_s=20)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """A failed scenario carries the last lines of every service's and node's log."""
    outcome = yield
    report = outcome.get_result()
    lab = getattr(item, "funcargs", {}).get("lab")
    if report.failed and isinstance(lab, Lab):
        report.sections.append(("multi-host lab logs", lab.logs(40)))
