"""One shape-only forward on the meta device: what each module call outputs, which outputs change in place, and on
request the convolution work the forward does.

Layer listings, ``feature_info``, hook sessions and the ``memory_format="auto"`` rule all read the same ``Trace``: no
compute, no download. It runs on a meta copy of the model, so the caller's model is never touched (attributes and
caches a forward fills included), also while other threads run it. Every module call of the copy goes to the trace's
own recorder instead of ``nn.Module``'s call machinery, so no hook runs on meta tensors: neither the user's (which the
copy does not carry) nor global ones (``register_module_forward_hook``). Each in-place change of a watched output is
recorded with the module call it happened in, when that call was handed exactly that tensor (an in-place ReLU right
after a tapped convolution), so an owner of the model can tell which changes switching such a module out of place
would remove.

With ``count_conv`` the forward also counts FLOPs as it goes: after each module call, the share of the FLOPs so far
done by convolutions and how often each convolution weight was used (``ConvWork``, the evidence
``featurehooks._formats`` decides by). The work does not depend on the memory format, so the trace runs as every
trace does, in the images' own format: the in-place changes it records (which taps a session clones) are those of
the NCHW forward ``memory_format="auto"`` runs by default. Whether the model runs in channels-last at all is a second
meta forward (``Trace.runs_channels_last``), with the channels-last strides the CPU and CUDA kernels give, so that
``"auto"`` never needs to run a user's forward again after a failure.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.flop_counter import FlopCounterMode

from ._copy import meta_copy
from ._taps import Site

__all__ = [
    "STATE",
    "CallOutput",
    "Change",
    "ConvWork",
    "StopForward",
    "Trace",
    "fixed_input_size",
    "trace",
    "trace_images",
    "tracing",
]

# aten ops that count as convolutions (``aten.convolution.default`` -> ``convolution``)
_CONVOLUTIONS = ("convolution", "_convolution", "conv2d", "cudnn_convolution")
# aten ops whose meta kernels give NCHW strides where the CPU kernels keep those of a channels-last input (measured
# on torch 2.14 over the 4-D ops of the usual backbones: convolutions, norms, pools, pads, resizes, shuffles,
# activations and arithmetic; the others agree)
_KEEPS_CHANNELS_LAST = frozenset(
    getattr(torch.ops.aten, name)
    for name in (
        "convolution",
        "native_group_norm",
        "pixel_shuffle",
        "channel_shuffle",
        "native_channel_shuffle",
        "reflection_pad2d",
        "replication_pad2d",
        "roll",
        "max_unpool2d",
    )
)


class StopForward(BaseException):
    """Raised to end a forward early: by the last tap of a session (never escapes the session's ``run``), and by the
    channels-last check of a trace once the deepest requested call returned.

    A BaseException, like KeyboardInterrupt, so a model's own ``except Exception:`` cannot swallow it.
    """


class _TraceState(threading.local):
    """Per thread: whether a meta trace is running (hook sessions ignore the forwards of a trace)."""

    active = False


STATE = _TraceState()


def tracing() -> bool:
    """Whether this thread is inside a meta trace."""
    return STATE.active


@dataclass(frozen=True)
class CallOutput:
    """The output of one module call: ``shape`` of a plain tensor output (None for containers and
    non-tensors), and ``order``, when its hook fired."""

    shape: tuple[int, ...] | None
    order: int


@dataclass(frozen=True)
class Change:
    """One in-place change of a watched output, seen when hook number ``order`` fired; ``by`` is the path of
    the module whose call made it, when that call's first argument was exactly that tensor (else None)."""

    order: int
    by: str | None


@dataclass(frozen=True)
class ConvWork:
    """The convolution work of a meta forward up to some module call.

    ``share``: the share of FLOPs in convolutions. ``reuse_per_pixel``: multiply-adds of the 2-D convolutions per
    weight element, per image and per input pixel; times an image's pixels it says how often each convolution
    weight is used in a forward of one image.
    """

    share: float
    reuse_per_pixel: float

    def reuse(self, height: int, width: int) -> float:
        """How often a convolution weight is used, on average, in the forward of one ``height x width`` image."""
        return self.reuse_per_pixel * height * width


@dataclass(frozen=True)
class _Inputs:
    """How a trace ran, to run it the same way again: its meta arguments, eval mode, and whether FLOPs were counted."""

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    eval_mode: bool
    count_conv: bool


@dataclass(frozen=True)
class Trace:
    """What one meta forward of a model with input ``input_shape`` showed.

    ``calls``: module path -> how often it ran. ``outputs``: (path, call) -> its output, in firing
    order. ``changes``: for the watched sites whose output (any tensor leaf) was changed in place
    after the module returned, every change in the order seen. ``reread``: of the paths the trace was
    asked to check, those whose input was read again after one of their calls returned.
    ``conv_work`` (with ``count_conv``): the convolution work up to each module call, and of the whole forward
    under the key None; calls without FLOPs before them are missing.
    """

    input_shape: tuple[int, ...]
    calls: Mapping[str, int]
    outputs: Mapping[Site, CallOutput]
    changes: Mapping[Site, tuple[Change, ...]]
    reread: frozenset[str]
    conv_work: Mapping[Site | None, ConvWork] = field(repr=False, compare=False)
    inputs: _Inputs = field(repr=False, compare=False)

    def last(self, sites: Collection[Site]) -> Site | None:
        """The one of ``sites`` that fires last (None without sites): where an early exit stops."""
        return max(sites, key=lambda site: self.outputs[site].order, default=None)

    def _stop(self, sites: Collection[Site], stop_early: bool) -> float:
        """The firing order after which the forward no longer runs (with early exit, the last of ``sites``)."""
        if not stop_early:
            return math.inf
        last = self.last(sites)
        return self.outputs[last].order if last is not None else -1

    def changed_by(self, sites: Collection[Site], stop_early: bool) -> dict[Site, frozenset[str | None]]:
        """For each of ``sites`` changed in place before the forward stops, what changed it (``Change.by``)."""
        stop = self._stop(sites, stop_early)
        found = {site: frozenset(c.by for c in self.changes.get(site, ()) if c.order <= stop) for site in sites}
        return {site: by for site, by in found.items() if by}

    def changed_in_place(self, sites: Collection[Site], stop_early: bool) -> frozenset[Site]:
        """Sites whose output is changed before the forward ends (or, with early exit, before the
        last of ``sites`` fires): these must be cloned when captured."""
        return frozenset(self.changed_by(sites, stop_early))

    def again(self, model: nn.Module, *, watch: Collection[Site], check_reads: Collection[str] = ()) -> Trace:
        """Trace ``model`` (this one, changed since) the same way again; ``check_reads`` as in ``trace()``."""
        return _run(model, self.inputs, watch, check_reads, {})

    def runs_channels_last(self, model: nn.Module, stop: Site | None) -> bool:
        """Whether ``model`` (this one, in whatever dtype it has now) runs this trace's forward up to the call
        ``stop`` (None: to its end) with its images in channels-last and its weights as they are, as
        ``memory_format="auto"`` runs it: a meta forward whose convolutions (and the few other ops
        ``_KEEPS_CHANNELS_LAST`` lists) give channels-last outputs, as the real kernels do, so that a ``.view``
        needing NCHW strides, or a layout check of the user's, fails here rather than in a real forward. Any
        exception means no. The CPU's random state is left as it was (a forward may draw on the CPU)."""
        copied = meta_copy(model)
        dtype = next((p.dtype for p in copied.parameters() if p.is_floating_point()), None)
        images = partial(_channels_last_image, dtype=dtype)
        args, kwargs = tree_map_only(torch.Tensor, images, (self.inputs.args, dict(self.inputs.kwargs)))
        try:
            with (
                torch.random.fork_rng(devices=[]),
                _calls_to(copied, _StopAfter(stop)),
                _ChannelsLast(),  # type: ignore[no-untyped-call]  # untyped in torch
                torch.inference_mode(False),
                torch.no_grad(),
            ):
                if self.inputs.eval_mode:
                    copied.eval()
                copied(*args, **kwargs)
        except StopForward:
            pass
        except Exception:  # the model's own error in channels-last: "auto" keeps it NCHW
            return False
        return True


class _ConvCounter:
    """Counts FLOPs while a trace runs, and after each module call notes the convolution work so far."""

    def __init__(self, pixels: int, work: dict[Site | None, ConvWork]) -> None:
        self.flops = FlopCounterMode(display=False)
        self.pixels = pixels  # images times input pixels: the work is per image and pixel
        self.work = work
        self._ran: set[int] = set()  # ids of the 2-D convolutions that ran
        self._weights = 0  # their weight elements

    def note(self, key: Site | None, module: nn.Module | None) -> None:
        """The work up to the call ``key`` (None: the whole forward), which ``module`` just made."""
        if isinstance(module, nn.Conv2d) and id(module) not in self._ran:
            self._ran.add(id(module))
            self._weights += module.weight.numel()
        counts = self.flops.flop_counts["Global"]
        total = sum(counts.values())
        if total:
            convolutions = sum(flops for op, flops in counts.items() if _op_name(op) in _CONVOLUTIONS)
            per_pixel = convolutions / 2 / self._weights / self.pixels if self._weights else 0.0
            self.work[key] = ConvWork(convolutions / total, per_pixel)


def _op_name(op: object) -> str:
    """``aten.convolution.default`` -> ``convolution``."""
    return str(getattr(op, "__name__", op)).split(".")[0]


class _Recorder:
    """Hooks on every module that record calls, output shapes and in-place changes with the call they happened in."""

    def __init__(self, watch: Collection[Site], reads: _Reads | None, counter: _ConvCounter | None) -> None:
        self.watch = set(watch)
        self.reads = reads
        self.counter = counter
        self.calls: dict[str, int] = {}
        self.outputs: dict[Site, CallOutput] = {}
        self.changes: dict[Site, list[Change]] = {}
        self._pending: list[list[Any]] = []  # [site, leaf, version last seen] of every watched output
        self._open: list[tuple[str, Any]] = []  # calls in progress, innermost last: (path, first argument)

    def call(self, path: str, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """One call of ``module``: changes seen before it happened outside it; it is open while it runs."""
        self.note_changes(len(self.outputs))
        self._open.append((path, args[0] if args else None))
        try:
            output = module.forward(*args, **kwargs)
            self._returned(path, module, output)
        finally:
            self._close(path)
        return output

    def _returned(self, path: str, module: nn.Module, output: Any) -> None:
        order = len(self.outputs)
        self.note_changes(order)
        call = self.calls.get(path, 0)
        self.calls[path] = call + 1
        site = (path, call)
        with _unseen():
            self.outputs[site] = CallOutput(tuple(output.shape) if isinstance(output, torch.Tensor) else None, order)
            if site in self.watch:
                leaves = (leaf for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor))
                self._pending.extend([site, leaf, leaf._version] for leaf in leaves)
            if self.counter is not None:
                self.counter.note(site, module)

    def _close(self, path: str) -> None:
        """Close the innermost call (of ``path``), also after an exception."""
        _, first = self._open.pop()
        if self.reads is not None and path in self.reads.paths and isinstance(first, torch.Tensor):
            self.reads.retire(first, path)

    def note_changes(self, order: int) -> None:
        """Record the watched outputs whose version moved since last seen, with the innermost call in progress."""
        path, first = self._open[-1] if self._open else (None, None)
        with _unseen():
            for pending in self._pending:
                site, leaf, version = pending
                if leaf._version != version:
                    self.changes.setdefault(site, []).append(Change(order, path if first is leaf else None))
                    pending[2] = leaf._version


def _unseen() -> AbstractContextManager[None]:
    """The recorder's own reads of shapes and versions: not the model's reads, and not worth a Python mode call each."""
    return torch._C.DisableTorchFunction()


def _root(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory ``tensor`` views (itself when it is no view)."""
    return tensor._base if tensor._base is not None else tensor


class _Reads(TorchFunctionMode):
    """Notes which of ``paths`` had an input read again (it, or a view of its memory) after their call returned."""

    def __init__(self, paths: Collection[str]) -> None:
        super().__init__()
        self.paths = frozenset(paths)
        self.reread: set[str] = set()
        self._retired: dict[int, tuple[torch.Tensor, str]] = {}  # id of the memory's root -> (root, path)

    def retire(self, tensor: torch.Tensor, path: str) -> None:
        root = _root(tensor)
        self._retired[id(root)] = (root, path)  # the root is held, so its id is not reused

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if self._retired and getattr(func, "__name__", "") != "__get__":  # reading .shape or ._version is no read
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor) and (hit := self._retired.get(id(_root(leaf)))) is not None:
                    self.reread.add(hit[1])
        return func(*args, **(kwargs or {}))


def trace(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    watch: Collection[Site] = (),
    eval_mode: bool = False,
    check_reads: Collection[str] = (),
    count_conv: bool = False,
) -> Trace:
    """Run ``model`` on meta tensors shaped like ``args`` and record every module call.

    ``watch`` names the sites whose in-place changes matter (the taps of a session).
    ``eval_mode`` runs in eval mode, as FeatureExtractor does (on the copy: the caller's flags stay).
    ``check_reads`` names modules whose inputs must not be read after their calls (``Trace.reread``).
    ``count_conv`` counts the forward's convolution work (``Trace.conv_work``).
    Raises whatever the model raises on meta tensors (data-dependent control flow, ops without
    meta kernels, fixed input sizes); callers decide what a failed trace means.
    """
    to_meta = partial(tree_map_only, torch.Tensor, lambda t: torch.empty_like(t, device="meta"))
    inputs = _Inputs(to_meta(tuple(args)), to_meta(dict(kwargs or {})), eval_mode, count_conv)
    return _run(model, inputs, watch, check_reads, {})


def _run(
    model: nn.Module,
    inputs: _Inputs,
    watch: Collection[Site],
    check_reads: Collection[str],
    work: dict[Site | None, ConvWork],
) -> Trace:
    """The one meta forward of ``model`` on ``inputs``; with ``inputs.count_conv`` the convolution work is noted into
    ``work`` as it runs."""
    copied = meta_copy(model)
    shape = next((tuple(a.shape) for a in tree_leaves(inputs.args) if isinstance(a, torch.Tensor)), ())
    reads = _Reads(check_reads) if check_reads else None
    counter = _ConvCounter(math.prod(shape[:1] + shape[2:]), work) if inputs.count_conv else None
    recorder = _Recorder(watch, reads, counter)

    def fresh(t: torch.Tensor) -> torch.Tensor:  # new meta tensors each run: a model may change its inputs in place
        return torch.empty_like(t)

    args, kwargs = tree_map_only(torch.Tensor, fresh, (inputs.args, dict(inputs.kwargs)))
    counting = counter.flops if counter is not None else contextlib.nullcontext()
    with _calls_to(copied, recorder.call):
        with torch.inference_mode(False), torch.no_grad(), reads or contextlib.nullcontext(), counting:
            if inputs.eval_mode:  # versioned tensors, no graph
                copied.eval()
            copied(*args, **kwargs)
            if counter is not None:
                counter.note(None, None)
        recorder.note_changes(len(recorder.outputs))
    changes = {site: tuple(found) for site, found in recorder.changes.items()}
    reread = frozenset(reads.reread) if reads is not None else frozenset()
    return Trace(shape, recorder.calls, recorder.outputs, changes, reread, work, inputs)


@contextlib.contextmanager
def _calls_to(copied: nn.Module, call: Callable[..., Any]) -> Iterator[None]:
    """While it lasts, each call of a module of ``copied`` (a meta copy) is ``call(path, module, *args, **kwargs)``
    instead of ``nn.Module``'s call machinery (``_compiled_call_impl``, which ``nn.Module.__call__`` runs when set, as
    ``module.compile()`` does): no hook runs, global ones included, and hook sessions see that a trace is running
    (``STATE``). Removed on the way out: each would hold its module in a cycle."""
    modules = list(copied.named_modules())
    for path, module in modules:
        vars(module)["_compiled_call_impl"] = partial(call, path, module)
    STATE.active, was_tracing = True, STATE.active
    try:
        yield
    finally:
        STATE.active = was_tracing
        for _, module in modules:
            vars(module).pop("_compiled_call_impl", None)


class _StopAfter:
    """Module calls of the channels-last check: counted per path as the recorder counts them, ``StopForward`` after
    ``stop`` returns (None: never): what runs after the deepest requested call does not matter."""

    def __init__(self, stop: Site | None) -> None:
        self.stop = stop
        self.calls: dict[str, int] = {}

    def __call__(self, path: str, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        output = module.forward(*args, **kwargs)
        call = self.calls.get(path, 0)
        self.calls[path] = call + 1
        if (path, call) == self.stop:
            raise StopForward
        return output


def _channels_last_image(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A fresh meta tensor like ``tensor``, in channels-last when it is a batch of images (as ``"auto"`` converts
    them), and in ``dtype`` (the model's) when floating."""
    layout = torch.channels_last if tensor.dim() == 4 else torch.preserve_format
    cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    return torch.empty_like(tensor, dtype=cast, memory_format=layout)


def _is_channels_last(value: object) -> bool:
    """A 4-D tensor with channels-last strides that are not also NCHW ones."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() == 4
        and value.is_contiguous(memory_format=torch.channels_last)
        and not value.is_contiguous()
    )


class _ChannelsLast(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped in torch
    """The ops of ``_KEEPS_CHANNELS_LAST`` give a channels-last input's 4-D outputs channels-last strides, as the
    CPU kernels (and cuDNN's convolutions) do; their meta kernels give NCHW ones."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        output = func(*args, **(kwargs or {}))
        if func.overloadpacket in _KEEPS_CHANNELS_LAST and any(_is_channels_last(a) for a in args[:2]):
            return tree_map_only(torch.Tensor, _as_channels_last, output)
        return output


def _as_channels_last(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous(memory_format=torch.channels_last) if tensor.dim() == 4 else tensor


def _channel_candidates(model: nn.Module) -> list[int]:
    """Input channel counts to try on a model that does not say: RGB, grayscale, then what its first
    convolution takes (verified by the trace, never trusted: space-to-depth stems take more)."""
    first_conv = next((m.in_channels for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    return list(dict.fromkeys(c for c in (3, 1, first_conv) if c is not None))


def fixed_input_size(model: nn.Module) -> tuple[int, int] | None:
    """The only ``(height, width)`` a model accepts, when it says so: a timm patch embedding with a strict
    image size (which may be non-square), torchvision's ViT; None for models that take any size."""
    embed = getattr(model, "patch_embed", None)
    size = getattr(embed, "img_size", None)
    if getattr(embed, "strict_img_size", False) and isinstance(size, tuple) and len(size) == 2:
        return (int(size[0]), int(size[1]))
    size = getattr(model, "image_size", None)
    if type(model).__module__.startswith("torchvision.models") and isinstance(size, int):
        return (size, size)
    return None


def trace_images(
    model: nn.Module,
    size: int | tuple[int, int],
    channels: int | None = None,
    *,
    watch: Collection[Site] = (),
    count_conv: bool = False,
) -> tuple[Trace, int | None]:
    """Trace ``model`` on a batch of two ``(C, height, width)`` images (``size`` or a square of it), in eval
    mode; returns the trace and ``C``. Two, so that an output's leading axis of 1 is never taken for the batch.
    ``watch`` and ``count_conv`` as in ``trace()``.

    ``channels`` comes from the model's metadata when it has some; otherwise the first count that
    traces is taken, and ``None`` is returned for a model that accepts any count.
    Raises the model's own error when no count traces.
    """
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    height, width = size if isinstance(size, tuple) else (size, size)

    def image(count: int) -> torch.Tensor:
        return torch.empty(2, count, height, width, dtype=dtype)  # the model's own dtype: a .double() module traces

    if channels is not None:
        return trace(model, (image(channels),), watch=watch, eval_mode=True, count_conv=count_conv), channels
    error: Exception | None = None
    for candidate in _channel_candidates(model):
        try:
            found = trace(model, (image(candidate),), watch=watch, eval_mode=True, count_conv=count_conv)
        except Exception as exc:  # the wrong channel count, or a model that cannot run on meta at all
            error = error or exc
            continue
        try:
            trace(model, (image(candidate + 2),), eval_mode=True)
        except Exception:
            return found, candidate
        return found, None
    raise error if error is not None else RuntimeError("model has no input to trace")
