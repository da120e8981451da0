"""DistributedDataParallel (notebooks 05-07): collectives and the ring all-reduce, the DDP job
that the course trains under ``launch`` and torchrun, DDP written by hand (hooks and buckets), and
mixed precision inside DDP (``amp``).

Import from the modules (``course_utils.ddp.train``, ``.by_hand``, ``.collectives``, ...).
"""
