"""kareus's graph passes, one per module; :mod:`~kareus.passes.pipeline` orders them.

Importing this package imports no pass: :mod:`~kareus.passes.names` (the pass names) stays
light for the config, and each user imports the passes it runs.
"""

from kareus.passes.names import PASS_NAMES

__all__ = ["PASS_NAMES"]
