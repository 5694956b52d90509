"""Sequence parallelism for the N-D family, Ulysses style (``ParallelismConfig(sp_size=...)``).

=================  ================================================================================
``ulysses.py``     the all-to-all around attention, :class:`~.ulysses.SequenceParallelAttention`
                   (the hook for a user's own attention)
``transformers.py``  a transformers model's attention and loss bound to the ``sp`` group
``loader.py``      a prepared loader's batches cut into this process's slice of every sequence
=================  ================================================================================

The loss over every slice is every strategy's (:mod:`anyaccel.strategies.loss`); the ``sp`` and
``loss`` groups are the job's mesh's (:class:`anyaccel.strategies.mesh.ProcessMesh`).
"""
