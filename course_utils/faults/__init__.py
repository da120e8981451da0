"""Failures and several nodes (notebook 09): snapshots that resume bitwise, the crashes the
notebook stages, torchrun from a notebook (restarts, several agents as nodes) and a Slurm script.

Import from the modules (``course_utils.faults.snapshots``, ``.torchrun``, ...).
"""
