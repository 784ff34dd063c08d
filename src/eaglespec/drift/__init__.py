"""Attention-drift diagnostics (`eaglespec drift`): per draft depth, where the drafter attends (sink tokens,
the rest of the context, its own drafted tokens), how large the state it feeds back is, and how often
its chains match the target. See forward.py (explicit attention), chains.py, measure.py, report.py."""
