"""Operating a mesh: the `pdmesh` command (`cli`), `pdmesh up` (`launcher`, over the one
process list in `topology`), NATS identities and permissions (`natsauth`) and the
development certificates of a multi-host cluster (`certs`).

The top layer: it may import any package; no service imports it.
"""
