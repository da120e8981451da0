"""Loaded by `make test`, `unit`, `nbval` and `stress`, and by the pytest that make stress runs over the
notebooks (``-p tests.early_plugin``), before pytest's plugins, nbval among them. It does two things.

1. It keeps out of every pytest process an import nothing here uses. nbval imports nbformat, which
   imports jsonschema, which imports ``rfc3987_syntax`` (installed with JupyterLab) to check the
   ``iri`` string format: building that module's grammar costs 0.86 CPU-s a process (measured),
   paid by pytest and each of its workers. nbformat validates notebooks without format checks, and
   nothing in the course checks an IRI, so jsonschema goes without (it skips a format whose module
   cannot be imported). Kernels, ranks and JupyterLab are not pytest processes: unaffected.
2. nbval's kernels are reached through socket files instead of TCP ports that a rank's connection
   can take before the kernel binds them (``course_utils/tools/kernels.py`` says why a taken port
   ends a kernel, and when ``make stress`` saw a kernel end so). ``tests/conftest.py`` does the
   same wherever it is loaded (a bare ``pytest tests``); this plugin reaches the runs that collect
   only ``notebooks/``.
"""

import sys

sys.modules.setdefault("rfc3987_syntax", None)  # None: `import rfc3987_syntax` raises ImportError


def kernels_over_socket_files() -> None:
    """nbval makes its ``KernelManager`` itself, by the name it imported: that name is replaced."""
    import nbval.kernel

    from course_utils.tools.kernels import kernel_manager_class

    nbval.kernel.KernelManager = kernel_manager_class(asynchronous=False)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("nbval"):
        kernels_over_socket_files()
