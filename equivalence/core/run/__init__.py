"""The two sides built and run: the inputs made once (``inputs``), what is read of the NNX model without
allocating it (``facts``), each side's setup (``setups``, and one file per kind's sides: ``model_side``,
``loop_side``, ``step_side`` over ``adapters``, which reads real step forms), each side run call by call
(``sides``), the twin of the run's own program (``nudge``), a check that would not fit refused (``fits``), a new
side pinned to its own mesh (``pinned``), each side's inputs as the run places them, shapes only, which the
pre-flight traces the run's own programs from (``abstract``), and what checks keep let go when the port's
code changes (``freshness``).

May import: ``state``, ``port``, ``rng``, ``measure``, ``record``.
"""
