"""DataParallel, the single-process way (notebooks 02-04): how ``nn.DataParallel`` splits a batch,
its four primitives written by hand and run on simulated devices, and where each device's memory
goes (DataParallel, ``output_device``, a parallel criterion, DDP).

Import from the modules (``course_utils.dataparallel.by_hand``, ``.splits``, ``.memory``, ...).
"""
