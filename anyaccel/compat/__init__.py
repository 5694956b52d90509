"""The Accelerate compatibility layer: Accelerate's names, module paths and argument formats,
converted into anyaccel's typed core objects.

A script written for Hugging Face Accelerate runs after ``sed s/accelerate/anyaccel/``: it finds
Accelerate's classes and functions under Accelerate's names, and ``Accelerator(...)`` accepts
Accelerate's arguments. All of that lives here, and only here:

* :mod:`.arguments`: ``Accelerator(...)``'s arguments (``kwargs_handlers``, ``fsdp_plugin``,
  ``deepspeed_plugin``, ``gradient_accumulation_plugin``, ``dynamo_plugin``/``dynamo_backend``,
  ...) against the launcher's settings, into the frozen :class:`~anyaccel.options.AcceleratorOptions`
  (:func:`~.arguments.resolve_options`);
* :mod:`.state`: ``PartialState`` and ``AcceleratorState``, read-only views of the resolved
  :class:`~anyaccel.environment.Environment` (where a process stands is the core's
  :class:`~anyaccel.job.JobView`);
* :mod:`.kwargs`: the ``*Kwargs`` handlers and ``GradientAccumulationPlugin``;
* :mod:`.plugins`: ``FullyShardedDataParallelPlugin`` (and the config file's ``fsdp_config``),
  ``TorchDynamoPlugin``;
* :mod:`.utils`: ``accelerate.utils`` submodule for submodule (``DeepSpeedPlugin`` in
  :mod:`.utils.deepspeed`), with the names anyaccel refuses (:mod:`.utils._refuse`).

Each Accelerate object converts into a core object with ``to_options()``
(:class:`~anyaccel.strategies.options.DDPOptions`, :class:`~anyaccel.strategies.fsdp.options.FSDPOptions`,
:class:`~anyaccel.strategies.deepspeed.config.DeepSpeedOptions`,
:class:`~anyaccel.process_group.ProcessGroupOptions`, :class:`~anyaccel.strategies.compile.CompileOptions`,
:class:`~anyaccel.accumulation.AccumulationOptions`); the core reads only those.

**The rule**: this package imports the core; the core never imports it (nor the top-level
paths below), so the core reads as anyaccel's own design and the Accelerate layer can change
without touching it. ``pyproject.toml``'s import-linter contracts enforce it (``lint-imports``).
Only the layers above the core use it: the ``Accelerator`` façade, the config file, the
launcher, ``anyaccel.test_utils``.

Users import from Accelerate's paths, which stay where they were as short re-exports:
``anyaccel.state``, ``anyaccel.kwargs``, ``anyaccel.plugins`` and the ``anyaccel.utils`` package,
whose ``anyaccel.utils.<name>`` *are* the modules of :mod:`.utils` (the same objects in
``sys.modules``). This package's ``__init__`` imports nothing, so importing one part costs only
that part.
"""
