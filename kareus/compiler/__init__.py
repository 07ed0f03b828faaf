"""What runs inside ``torch.compile``: the backend, lowering, applying a plan, config, explain.

Everything a user's ``kareus.compile(model)`` call reaches lives here; the command-line jobs
(:mod:`kareus.jobs`) and the planner's algorithms (:mod:`kareus.planner`) do not.
"""
