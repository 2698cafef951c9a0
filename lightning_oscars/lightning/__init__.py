"""The glue to Lightning: the strategies and everything one fit installs in a ``Trainer``.

The strategies (``strategy``, ``strategy_options``, ``collectives``, ``paradigms``), one fit's session and the
callbacks through which Lightning's loop drives it (``session``, ``callbacks``, ``agreement``, ``epoch_metrics``),
recovery from a lost rank (``recovery``, ``fit_failures``), the user's tools (``monitor``, ``heterogeneity``) and the
patches of Lightning's loops (``adapter`` and the pieces it installs). Lightning's private state is read and written
in ``internals`` and ``epoch_metrics`` only. Imports ``core`` and ``dist``.
"""
