"""The round logic, free of Lightning and of ``torch.distributed``: what a fit's rounds are and how they are planned.

Timing and the schedule (``timing``, ``schedule``, ``solver``, ``policy``), the epoch's plan and its slots
(``epoch_shape``, ``partition``, ``quotas``, ``reservations``, ``deadline``, ``deadline_planner``, ``warmup``,
``slots``, ``loader``, ``epoch_order``, ``replicas``), one fit's rounds (``rounds``, ``ledger``, ``control``), the
paradigms' rules (``staleness``, ``groups``, ``shard``), recovery's bookkeeping (``continuation``,
``recovery_points``) and the ``timeline`` picture. Modules here import only each other, torch's tensors and the
standard library: they are unit-tested directly and driven by the simulator in ``benchmarks/simulator``.
"""
