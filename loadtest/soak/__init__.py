"""`pdmesh soak`: the canary workload against a running mesh, every reply judged.

`run` is the command; `workload` derives each request from (seed, index); `verdict` judges
each reply against the output oracle and tallies; `fingerprints` checks before the run that
the workers compute the oracle's bits; `pool` checks after the run that every KV lease is
back and every pool passes its integrity check.
"""
