"""Speculation, behind one seam (``speculator.Speculator``):

- ``drafter``: the protocol every drafter follows (the drafters live in ``specserve.drafts``);
- ``paths``: draft paths, a static draft tree forked from a request's own draft;
- ``rejection_sampler``: verification, lossless for greedy and sampled requests;
- adaptive draft lengths: ``acceptance`` (what is accepted), ``cost_model`` (what a step
  costs), ``planner`` (the plan, a pure function of those), ``goodput`` (whether the plan
  delivers), ``controller`` (all of them, step by step) and ``running`` (the running
  requests as the controller sees them).
"""
