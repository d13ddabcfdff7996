"""`pdmesh up` hands each service, and its NATS server, a loopback port of its own: the OS's
"free port" is only free until someone binds it, and the services bind theirs later, so
without this two of them (or one and the gateway) could be handed the same port."""

from __future__ import annotations

import pytest

from pdmesh.services.ops.launcher import PortAllocator, free_port
from pdmesh.services.protocol.errors import StartupError


def test_a_port_is_never_handed_out_twice_nor_the_gateways() -> None:
    offered = iter([8000, 8001, 8001, 8000, 8002, 8001, 8003])
    fresh = PortAllocator({8000}, pick=lambda: next(offered))
    assert [fresh(), fresh(), fresh()] == [8001, 8002, 8003]
    assert fresh.taken == {8000, 8001, 8002, 8003}


def test_it_gives_up_with_a_clear_error_rather_than_repeat() -> None:
    fresh = PortAllocator({8000}, pick=lambda: 8000)
    with pytest.raises(StartupError, match="distinct"):
        fresh()


def test_real_ports_are_distinct() -> None:
    gateway = free_port()
    fresh = PortAllocator({gateway})
    ports = [fresh() for _ in range(20)]
    assert len(set(ports)) == 20 and gateway not in ports
