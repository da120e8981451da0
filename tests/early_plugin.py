"""Loaded by `make test`, `unit`, `nbval` and `stress` (``-p tests.early_plugin``) before pytest's
plugins, nbval among them: it only keeps out of every pytest process an import nothing here uses.

nbval imports nbformat, which imports jsonschema, which imports ``rfc3987_syntax`` (installed with
JupyterLab) to check the ``iri`` string format: building that module's grammar costs 0.86 CPU-s a
process (measured), paid by pytest and each of its workers. nbformat validates notebooks without
format checks, and nothing in the course checks an IRI, so jsonschema goes without (it skips a format
whose module cannot be imported). Kernels, ranks and JupyterLab are not pytest processes: unaffected.
"""

import sys

sys.modules.setdefault("rfc3987_syntax", None)  # None: `import rfc3987_syntax` raises ImportError
