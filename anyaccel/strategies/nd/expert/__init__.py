"""Expert parallelism's place in the N-D family (issue 39): MoE layers whose experts are split over
an ``ep`` group, tokens dispatched to them with an all-to-all.

Empty until expert parallelism lands. What it will take (docs/extending/strategies.md, "Adding a
dimension"): the ``ep`` dimension and its uses in :mod:`anyaccel.strategies.mesh` (``ep`` for the
dispatch all-to-all; ``expert_sharding`` for the data-parallel processes ep does not use, over
which the experts are FSDP-sharded), ``ep_size`` in :class:`~anyaccel.strategies.nd.options.ParallelismConfig`
with its option row (:mod:`anyaccel.optionspec`), the dispatcher and the expert sharding here,
and one step in :meth:`NDStrategy._parallelize <anyaccel.strategies.nd.strategy.NDStrategy._parallelize>`
(experts after tensor parallel, before FSDP). ``expert/`` sits beside ``pipeline/``, ``sequence/``
and ``tensor_parallel.py``: it imports none of them.
"""
