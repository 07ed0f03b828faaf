"""The command line's work: trace a workload, plan it, profile it, price plans, report.

Each module is one job of ``kareus ...``: :mod:`~kareus.jobs.workload` (``kareus plan``),
:mod:`~kareus.jobs.trace`, :mod:`~kareus.jobs.profile`, :mod:`~kareus.jobs.evaluate`.
"""
