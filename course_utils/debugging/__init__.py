"""Debugging distributed training (notebook 12): a hang-safe zoo of real failures, where each
stuck rank waits, the Flight Recorder, training-loop bugs with their references, and gradient
compression with communication hooks.

Import from the modules (``course_utils.debugging.hangs``, ``.failure_zoo``, ...).
"""
