"""The launcher's machinery, behind ``course_utils.distributed.launch`` (notebook 05).

Learners never import these modules: the names notebooks use (``launch``, ``RankError``,
``LaunchTimeout``, ``rank_print``) are imported from ``course_utils.distributed``, and torchrun's
from ``course_utils.faults.torchrun``.

- ``rank``: the rank side: a rank's entry point, forked or a fresh interpreter
  (``python -m course_utils.launcher.rank WORKDIR RANK``); sets up the group, runs ``fn``, writes
  its result;
- ``forkserver``: fast starts: ranks forked from a clean server that imported torch once, and the
  fallback to fresh interpreters;
- ``shared_server``: one fork server for a whole test session (``make test``, ``make compat``),
  named in ``COURSE_FORKSERVER``;
- ``kernel``: ``make test``'s notebook kernels, forked from that server (a stand-in process passes
  Jupyter's signals on);
- ``processes``: results, stopping a rank and its children, the stacks of stuck ranks;
- ``waiting``: waiting for the ranks, the rank to blame when one fails (``RankError``), what a
  timeout reports (``LaunchTimeout``);
- ``pickling``: what travels to a rank (by reference or by value, with cloudpickle), and a clear
  error for what cannot.
"""
