"""Shared test configuration.

Do not set MPLBACKEND here: the notebooks' kernels inherit this process's environment, and a
non-interactive backend would stop their plots from being displayed (and compared).
Unit tests that plot select the Agg backend themselves.
"""
