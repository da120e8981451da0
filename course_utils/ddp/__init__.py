"""DistributedDataParallel (notebooks 05-08): collectives and the ring all-reduce, the DDP job that
the course trains under ``launch`` and torchrun (05), DDP written by hand: hooks, buckets, no_sync
(06), what the global batch does to training: the task, the sweep of learning-rate rules, the
noise scale, accumulation (07), and mixed precision inside DDP (``amp``, 08).

Import from the modules (``course_utils.ddp.train``, ``.by_hand``, ``.collectives``, ...).
"""
