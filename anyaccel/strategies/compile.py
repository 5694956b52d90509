"""Compiling the user's module in place, and saying so when Dynamo compiled nothing.

**Why not ``nn.Module.compile()``.** It compiles the bound ``_call_impl`` (torch/nn/modules/module.py),
a frame in Dynamo's skip list: Dynamo then only catches the frames called from it that are user code
— a subclass's own ``forward``. For a model whose ``forward`` is torch.nn's own (``nn.Sequential``,
``nn.TransformerEncoder``, a subclass that does not override ``forward``) every frame is skipped and
the model runs eager without a word (torch 2.13: ``counters["frames"]`` stays empty).

**Why not ``torch.compile(model)``.** It returns an ``OptimizedModule`` wrapper: parameter names gain
``_orig_mod.``, and ``prepare`` would hand back another object than the user's.

**What we do** (:func:`compile_in_place`): choose the frame by the rule ``OptimizedModule`` uses,
applied to the module itself through the slot ``nn.Module.compile`` uses (``_compiled_call_impl``,
called by ``Module.__call__``):

* ``forward`` is user code (a subclass; torchvision-style models): ``torch.compile(module._call_impl)``,
  exactly ``nn.Module.compile``. The module's own hooks run eagerly and Dynamo compiles the
  ``forward`` frame (its cache is keyed on the class's ``forward``, shared by instances).
* ``forward`` is torch's (Dynamo's ``trace_rules.check`` says it would be skipped):
  ``_compiled_call_impl`` runs ``Module._call_impl``'s code eagerly (the hooks, FSDP2's included,
  run as without compile), made once from torch's source with the forward passed as an argument
  instead of read as ``self.forward``: it gets a compiled function of our own around the forward
  ``_call_impl`` would have called (the class's, or one set on the instance such as anyaccel's
  autocast wrapper). The instance is never modified (calls from several threads, hooks reading
  ``module.forward``, pickling during a call all see the module as it is). That function's frame
  is not in the skip list, so Dynamo traces ``forward`` and the children it calls as one graph.
  Each module gets its own copy of its code object, so each has its own Dynamo cache (no
  recompilations, no ``recompile_limit`` shared between models). ``torch.compile(model)`` traces
  the hooks instead (``external_utils.wrap_inline``), which under FSDP2 compiles nothing: its hooks
  are ``torch._dynamo.disable``-d and break the graph at the top (measured, torch 2.13).

What this keeps: the user's object and class (FSDP2 may still swap the class in place: the slot is
in the instance's ``__dict__``), parameter names and ``state_dict`` keys, ``train()``/``eval()``
(Dynamo guards on ``training`` and recompiles once), hooks (run eagerly, added or removed at any
time), pickling (drops the slot, as ``Module.__getstate__`` does for ``nn.Module.compile``: the
unpickled module runs eager), ``copy.deepcopy`` (the copy, an EMA or teacher model, is compiled
the same way at its first call), DDP (its ``forward`` calls ``module(...)``, which
reaches the slot) and FSDP2 (its hooks run eagerly around the compiled forward). A block that
FSDP2 shards on its own has hooks inside the root's forward, which break the root's graph (Dynamo
then runs the root's ``forward`` eagerly): so each such block is compiled in place too
(``Strategy.compile_block``), and its forward is compiled whatever happens to the root's.

**The check** (:func:`watch_first_call`): the slot is first filled with a function that reads
Dynamo's counters before and after the first call, puts the compiled callable in its place (later
calls pay nothing; a first call that raises leaves the check for the next one) and warns once,
naming the model's class and the reason when one is known, if that call compiled no graph and found
none cached for the model.
"""

from __future__ import annotations

import copy
import functools
import types
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from .. import lazyclass

__all__ = ["CompileOptions", "compile_in_place", "watch_first_call", "compiled_by_user", "user_compile_reason", "dynamo_counts",
           "orig_module", "without_compile"]


@lazyclass.dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """How a strategy compiles the models it prepares (``torch.compile``'s arguments): ``backend``
    (``"inductor"``, ...; None, ``"no"`` or ``disable`` compiles nothing), ``mode``, ``fullgraph``,
    ``dynamic``, ``options`` (the backend's). Accelerate's ``TorchDynamoPlugin`` and the
    ``dynamo_backend`` argument convert into it (``to_options()``). Local; frozen."""

    backend: Optional[str] = None
    mode: Optional[str] = None
    fullgraph: Optional[bool] = None
    dynamic: Optional[bool] = None
    options: Optional[Mapping[str, Any]] = None
    disable: bool = False

    @property
    def enabled(self) -> bool:
        """True when models are compiled. Local."""
        return not self.disable and self.backend not in (None, "no", "none", "")

    def compile_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments for ``torch.compile`` (unset ones left out). Local."""
        out: Dict[str, Any] = {"backend": self.backend}
        for name in ("mode", "fullgraph", "dynamic"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.options is not None:
            out["options"] = dict(self.options)
        return out


def dynamo_counts() -> Tuple[int, int]:
    """(frames Dynamo converted, graphs it compiled) in this process so far. Local."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"]), int(counters["stats"]["unique_graphs"])


def compiled_by_user(model: torch.nn.Module) -> bool:
    """True for a model compiled before ``prepare``: by the user (``torch.compile(model)``, an
    ``OptimizedModule``, or ``model.compile()``), or by anyaccel at an earlier ``prepare``. Local."""
    return orig_module(model) is not None or model.__dict__.get("_compiled_call_impl") is not None


def compile_in_place(model: torch.nn.Module, options: Dict[str, Any], watch: bool = True) -> torch.nn.Module:
    """Compile ``model`` itself with ``torch.compile(**options)`` (see the module docstring for
    which frame and why) and, if ``watch``, check its first call; return the same object. A
    ``copy.deepcopy`` of it is compiled the same way at its first call. Local (every process
    compiles its own copy)."""
    if _skipped_by_dynamo(model):
        target, code = _forward_through_own_frame(model, options)
    else:
        target, code = torch.compile(model._call_impl, **options), type(model).forward.__code__
    target._anyaccel_code = code  # type: ignore[attr-defined]  # compiled by anyaccel (a second prepare sees it)
    model._compiled_call_impl = target
    model.__dict__[_RECIPE] = _Recipe(model, options, watch)
    return watch_first_call(model, codes=[code]) if watch else model


_RECIPE = "_anyaccel_compile"


class _Recipe:
    """Kept in the compiled module's ``__dict__``: how it was compiled, so that ``copy.deepcopy``
    (an EMA or teacher copy) compiles the copy the same way instead of running it eager
    (``Module.__getstate__`` drops the compiled slot). Pickling drops it (the unpickled module
    runs eager, as with ``nn.Module.compile``)."""

    def __init__(self, model: Optional[torch.nn.Module], options: Dict[str, Any], watch: bool) -> None:
        self.model_id, self.options, self.watch = id(model), options, watch

    def __deepcopy__(self, memo: Dict[int, Any]) -> Optional["_Recipe"]:
        # copy.deepcopy registers the new module in ``memo`` before it copies the module's state:
        # its slot is set now (Module.__setstate__ only adds to __dict__) and compiles it at its
        # first call, once the copy is complete.
        copied = memo.get(self.model_id)
        if not isinstance(copied, torch.nn.Module):
            return None
        options, watch = self.options, self.watch

        def compile_copy(*args: Any, **kwargs: Any) -> Any:
            compile_in_place(copied, options, watch)
            return copied._compiled_call_impl(*args, **kwargs)

        compile_copy._anyaccel_code = None  # type: ignore[attr-defined]  # anyaccel's: prepare leaves it
        compile_copy._anyaccel_first_call = True  # type: ignore[attr-defined]  # checked once compiled
        copied.__dict__["_compiled_call_impl"] = compile_copy
        return _Recipe(copied, options, watch)

    def __reduce__(self) -> Tuple[Any, ...]:
        return (type(None), ())  # unpickled as None: a pickle of the model needs no anyaccel to load


def without_compile(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as a module that is not compiled: itself when neither it nor a submodule was
    compiled in place; otherwise a shallow copy of each compiled module (and of the modules on
    the way to one) without the compiled slot, sharing every parameter, buffer and other
    submodule with ``model``, which stays compiled. Like ``torch.compile``'s ``_orig_mod``: what
    ``unwrap_model(model, keep_torch_compile=False)`` returns (``torch.jit.trace``, export).
    Local."""
    return _without_compile(model, {})


def _without_compile(module: torch.nn.Module, memo: Dict[int, torch.nn.Module]) -> torch.nn.Module:
    if id(module) in memo:
        return memo[id(module)]
    children = {name: _without_compile(child, memo) for name, child in module._modules.items() if child is not None}
    changed = {name: child for name, child in children.items() if child is not module._modules[name]}
    plain = module
    if changed or module.__dict__.get("_compiled_call_impl") is not None:
        plain = copy.copy(module)  # Module.__getstate__ leaves the compiled slot out
        plain.__dict__.pop("_compiled_call_impl", None)
        plain.__dict__.pop(_RECIPE, None)
        if changed:
            plain.__dict__["_modules"] = {**module._modules, **changed}
    memo[id(module)] = plain
    return plain


def _forward_through_own_frame(model: torch.nn.Module, options: Dict[str, Any]) -> Tuple[Callable[..., Any], Any]:
    """For a module whose ``forward`` Dynamo skips: a ``_call_impl`` replacement that runs the hooks
    eagerly (``Module._call_impl``'s own code) and ``forward`` through a compiled frame of its own.
    The instance is never modified: the forward is handed to ``_call_impl``'s code as an argument
    (safe with calls from several threads, hooks see the module as it is)."""

    def run_forward(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    run_forward.__code__ = run_forward.__code__.replace()  # a code object, so a Dynamo cache, per module
    compiled = torch.compile(run_forward, **options)
    own = model.__dict__
    call_with = _call_impl_with_forward()

    bound: Dict[Any, Any] = {}  # the class's forward bound once: Dynamo guards on this object's identity

    def call(*args: Any, **kwargs: Any) -> Any:
        # the forward Module._call_impl would have called (the class's, or one set on the
        # instance such as the autocast wrapper), run through the compiled frame. A new bound
        # method per call would be freed after it, which (torch 2.9) invalidates the cache entry
        # guarding on it: a recompilation per call, then eager at the recompile limit.
        forward = own.get("forward")
        if forward is None:
            function = type(model).forward  # FSDP2 may swap the class: rebind when it changes
            forward = bound.get(function)
            if forward is None:
                bound.clear()
                forward = bound[function] = types.MethodType(function, model)
        return call_with(model, functools.partial(compiled, forward), *args, **kwargs)

    return call, run_forward.__code__


@functools.lru_cache(maxsize=None)
def _call_impl_with_forward() -> Callable[..., Any]:
    """``Module._call_impl`` with the forward it calls passed as its second argument instead of
    looked up as ``self.forward``: the same code (hooks, FSDP2's included, global hooks, backward
    hooks), made from this torch's source and run in its module's globals. Raises RuntimeError
    naming the torch version when that source has another shape."""
    import inspect
    import textwrap

    from torch.nn.modules import module as module_py

    src = textwrap.dedent(inspect.getsource(torch.nn.Module._call_impl))
    head = "def _call_impl(self, *args, **kwargs):"
    if not src.startswith(head) or src.count("self.forward") != 1:
        raise RuntimeError(f"anyaccel cannot compile a torch.nn module's own forward with torch {torch.__version__}: "
                           "Module._call_impl has an unexpected shape; compile a subclass with its own forward, "
                           "or turn compile off, and report this to anyaccel")
    src = "def _call_impl(self, _anyaccel_forward, *args, **kwargs):" + src[len(head):]
    namespace: Dict[str, Any] = {}
    exec(compile(src.replace("self.forward", "_anyaccel_forward"), module_py.__file__, "exec"),  # noqa: S102
         module_py.__dict__, namespace)
    return namespace["_call_impl"]




def watch_first_call(model: torch.nn.Module, codes: Optional[List[Any]] = None,
                     reason: Optional[str] = None) -> torch.nn.Module:
    """Arrange that the first call of ``model`` (anyaccel-compiled, or compiled by the user) warns
    once if Dynamo compiled no graph for it and found none in the cache of ``codes``. ``reason``: a
    cause known beforehand, put in the warning. Later calls cost nothing: the check removes
    itself. Returns ``model``. Local (each process checks and warns for itself)."""
    compiled = model.__dict__.get("_compiled_call_impl")
    if getattr(compiled, "_anyaccel_first_call", False):
        return model  # prepared twice: one check is enough
    if codes is None:
        codes = _user_compiled_codes(model)
    name = type(orig_module(model) or model).__name__

    baseline: List[Any] = []  # counters before the first call; kept while first calls raise

    def first_call(*args: Any, **kwargs: Any) -> Any:
        model._compiled_call_impl = compiled  # None for an OptimizedModule: Module.__call__ as usual
        if not baseline:
            baseline.extend((dynamo_counts(), _graph_break_reasons()))
        try:
            out = compiled(*args, **kwargs) if compiled is not None else model._call_impl(*args, **kwargs)
        except BaseException:
            if model.__dict__.get("_compiled_call_impl") is compiled:
                model._compiled_call_impl = first_call  # the next call checks, counting from here
            raise
        new_frames, new_graphs = (a - b for a, b in zip(dynamo_counts(), baseline[0]))
        if new_graphs == 0 and not (new_frames == 0 and _cached(codes)):
            _warn_eager(name, reason or _why_nothing(baseline[1]))
        return out

    first_call._anyaccel_first_call = True  # type: ignore[attr-defined]
    model._compiled_call_impl = first_call
    return model


def _warn_eager(name: str, reason: str) -> None:
    warnings.warn(f"torch.compile compiled nothing for this {name} at its first call: it runs eager ({reason}). "
                  "TORCH_LOGS=+dynamo shows what Dynamo did; torch._dynamo.utils.counters['frames'] counts "
                  "the frames it compiled", stacklevel=4)


def _skipped_by_dynamo(model: torch.nn.Module) -> bool:
    """Whether Dynamo would skip ``model.forward`` as a top frame (torch.nn's own code)."""
    from torch._dynamo import config, trace_rules

    forward = model.forward
    wrap_top_frame = getattr(config, "wrap_top_frame", False)  # recent torch only
    return bool(wrap_top_frame) or (hasattr(forward, "__func__") and bool(trace_rules.check(forward)))


def orig_module(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The module inside ``torch.compile``'s ``OptimizedModule`` wrapper (its ``_orig_mod``), or
    None for any other module. Local."""
    inner = model.__dict__.get("_modules", {}).get("_orig_mod")
    return inner if isinstance(inner, torch.nn.Module) else None


def _user_compiled_codes(model: torch.nn.Module) -> List[Any]:
    """The code objects whose Dynamo cache holds a user-compiled model's graphs (a cache hit on
    the first call after ``prepare`` is not "compiled nothing")."""
    inner = orig_module(model) or model
    codes = [getattr(type(inner).forward, "__code__", None)]
    fn = model.__dict__.get("forward") if orig_module(model) is not None else model.__dict__.get("_compiled_call_impl")
    codes.append(getattr(getattr(fn, "_torchdynamo_orig_callable", None), "__code__", None))
    codes.append(getattr(fn, "_anyaccel_code", None))  # compiled by anyaccel, prepared again
    return [c for c in codes if c is not None]


def _cached(codes: List[Any]) -> bool:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return any(_debug_get_cache_entry_list(code) for code in codes)


def _graph_break_reasons() -> Dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def _why_nothing(breaks_before: Dict[str, int]) -> str:
    from torch._dynamo import config

    if config.disable:
        return "Dynamo is disabled: TORCHDYNAMO_DISABLE=1 or torch._dynamo.config.disable"
    new = [r for r, n in _graph_break_reasons().items() if n > breaks_before.get(r, 0)]
    if new:
        return "graph break: " + new[0].splitlines()[0][:300]
    return "Dynamo skipped every frame; the reason is not known here"


def user_compile_reason(model: torch.nn.Module) -> Optional[str]:
    """Why a model compiled by the user with ``model.compile()`` cannot compile, if known
    beforehand (torch.nn's own ``forward``). Local."""
    slot = model.__dict__.get("_compiled_call_impl")
    by_user = orig_module(model) is None and slot is not None and not hasattr(slot, "_anyaccel_code")
    if by_user and _skipped_by_dynamo(model):
        return ("nn.Module.compile() compiles the bound _call_impl, which Dynamo skips for torch.nn's own "
                f"forward ({type(model).__name__}.forward); use torch.compile(model) or "
                "Accelerator(dynamo_backend=...) instead")
    return None
