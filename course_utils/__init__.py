"""Helpers for the runnable course on PyTorch data parallelism.

Each module holds one idea and names the notebook that introduces it. Importing the package is
cheap: it does not import torch's heavier parts and never initialises CUDA.
"""

__version__ = "0.1.0"

#: The one place that names the course's repository. The Colab badges and the set-up cell of
#: every notebook are built from it (``python -m course_utils.tools.nbtools sync``), and a test keeps
#: them in step.
#: ``BRANCH`` is the git ref that a notebook opens from (its badge) and installs (its set-up
#: cell), so that a notebook always installs the helpers of its own version: a release sets it
#: to its tag (``v0.2.0``) and runs ``nbtools sync`` before tagging.
REPO = "pytorch-data-parallel-course/course"
BRANCH = "main"

__all__ = ["BRANCH", "REPO", "__version__"]
