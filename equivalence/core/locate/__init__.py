"""Where the two sides part on the first step: recorded once per verdict (``first_step``,
``recorded_run``), read stage by stage (``forward``, ``stages``, ``slots``, ``averages``, ``implied``,
``collectives``) into a place (``locate``); against a reference of another JAX (``upgrade``); the
first step held module by module where noise-dominated leaves cannot verify (``hidden``).

May import: every room below it.
"""
