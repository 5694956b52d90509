"""Pipeline parallelism for the N-D family (``ParallelismConfig(pp_size=...)``).

=================  ================================================================================
``schedule.py``    :class:`~.schedule.Pipeline`: this process's stages, torch's schedule, one step
                   (:class:`~.schedule.PipelineStep`, run by ``Accelerator.backward``)
``split.py``       where a model is cut into stages (block boundaries, parameter names kept)
``ties.py``        weights tied across stages kept equal, as Megatron does
``strategy.py``    :class:`~.strategy.PipelinedStrategy`: what a sharding strategy does differently for
                   a model cut into stages (the :class:`~anyaccel.strategies.capabilities.Pipelined`
                   capability)
=================  ================================================================================

The stage placement is the job's mesh's (:meth:`anyaccel.strategies.mesh.ProcessMesh.stage_ranks`).
"""
