"""Upgrade planning: from simulated backfill curves to a plan (docs/planning.md).

Modules (one concept each):

* :mod:`~raycompat.planning.inputs`    -- candidate models' curves (simulate-backfill or main
  job reports), checked to share one old model and one gallery
* :mod:`~raycompat.planning.rates`     -- embedding, psi refresh and search rates: given, read
  from an embed-gallery summary, or measured on the spot
* :mod:`~raycompat.planning.timeline`  -- each option on the wall clock: milestones, cost,
  quality-hours, the hour it passes old-old
* :mod:`~raycompat.planning.recommend` -- constraints, the recommendation, the binding
  constraint and what would relax it
* :mod:`~raycompat.planning.plan`      -- :func:`make_plan`: every option assessed
* :mod:`~raycompat.planning.report`, :mod:`~raycompat.planning.plots` -- plan.md, plan.json, PNGs
* :mod:`~raycompat.planning.job`       -- ``raycompat plan-upgrade`` / ``jobs/plan_upgrade.py``
"""
