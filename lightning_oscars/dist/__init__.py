"""What talks over ``torch.distributed``: how replicas are combined where they meet, and the exchanges in between.

The flat all-reduce and what it carries (``averaging``, ``local_state``), the schemes a round ends with (``schemes``,
``outer``, ``overlap``), the parameter server (``param_server``, ``server_scheme``), Ripples' groups (``ripples``),
collectives inside a local step (``local_collectives``), naming a failed rank (``faults``) and the process groups'
lifecycle (``_c10d``, the one module that touches torch's private state). Imports ``core``, never Lightning.
"""
