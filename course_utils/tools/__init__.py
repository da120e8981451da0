"""The course's tools, which no lesson imports: each one is a command behind a make target.

``nbtools`` (``make execute``; hygiene and badges), ``preflight`` (``make preflight``),
``gpu_check`` (``make gpu-check``), ``bench`` (``make bench``), ``compat_check`` (``make compat``)
and ``editions`` (``make editions``). Run them as ``python -m course_utils.tools.<name>``.
"""
