"""The training loop's pieces the ``Accelerator`` composes: when an optimizer step really happens
(``stepping``), gradient accumulation (``accumulation``), freeing memory and retrying with a smaller
batch (``memory``), and fp8 training (``precision_fp8``, with Transformer Engine's half in
``precision_te``).

Mixed precision's autocast policy is not here but in :mod:`anyaccel.precision`: the strategies use
it, and this package sits above them (fp8 asks the strategy base to unwrap a model). Empty on
purpose: importing the package imports none of its modules.
"""
