"""DistributedDataParallel (notebooks 05-07 and 13): collectives and the ring all-reduce, the DDP
job that the course trains under ``launch`` and torchrun, DDP written by hand (hooks and buckets),
mixed precision inside DDP (``amp``), and what the global batch does to training (notebook 13:
the task, the sweep of learning-rate rules, the noise scale, accumulation).

Import from the modules (``course_utils.ddp.train``, ``.by_hand``, ``.collectives``, ...).
"""
