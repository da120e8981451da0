"""Sharded data parallelism and choosing a strategy (notebooks 10-11): ZeRO by hand, the memory
and bytes-sent ledgers, the runs through PyTorch's APIs (``ZeroRedundancyOptimizer``, FSDP2, DCP),
HSDP on a 2-D mesh, and the harness that measures one job under every strategy.

Import from the modules (``course_utils.sharding.zero``, ``.ledgers``, ``.runs``, ...).
"""
