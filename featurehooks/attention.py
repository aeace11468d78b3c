"""Attention maps of a model's own forward, fused attention included, and their rollout across layers.

``capture_attention`` never switches a module to its unfused path: while a chosen attention module runs, a torch
function mode (``_Recorder``) sees the ``F.scaled_dot_product_attention`` call the module makes and recomputes
``softmax(q kᵀ · scale + mask)`` from that call's own ``q``, ``k``, ``scale`` and mask (so relative position
biases, shift masks, rope and prefix tokens are whatever the module passed), or, on an unfused path, keeps the
softmax output the module computed. ``nn.MultiheadAttention``, whose fast path runs one fused kernel and which a
mode would push off that path, is read from its weights and the arguments of its call instead
(``_attention_kinds.mha_weights``).
Either way every call is passed through unchanged: the model's outputs are bitwise those without capture.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ._attention_kinds import (
    MHA,
    attention_kind,
    attention_modules,
    class_name,
    folded,
    mha_weights,
    refusal,
    sdpa_weights,
)
from ._capture import refuse_torchscript
from ._hooks import InertInCopies, Observer, ObserverSession
from ._taps import call_name
from .errors import InvalidTypeError, InvalidValueError, LayerNotFoundError, LayerNotRunError, did_you_mean
from .extractor import FeatureExtractor
from .layers import select_modules

__all__ = ["AttentionMaps", "attention_rollout", "capture_attention"]

HeadFusion = Literal["mean", "max", "min"]

_SDPA = F.scaled_dot_product_attention
_SOFTMAX = frozenset({torch.Tensor.softmax, torch.softmax, F.softmax, torch.special.softmax})


class _Recorder(TorchFunctionMode):
    """Active during one call of an attention module: passes every torch call through unchanged, and keeps the
    weights of each scaled-dot-product attention call and the output of each softmax over the last axis."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.sdpa: list[Tensor] = []
        self.softmax: list[Tensor] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: object,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _SDPA:
            self.sdpa.append(sdpa_weights(*args, **kwargs))
        elif func in _SOFTMAX and isinstance(out, Tensor) and _over_last_axis(out, args, kwargs):
            self.softmax.append(out.detach())
        return out

    def weights(self, path: str, module: nn.Module) -> Tensor:
        """The module's one attention map, ``(batch, heads, queries, keys)``; windows, groups fold into batch."""
        if len(self.sdpa) == 1:
            found = self.sdpa[0]
        elif not self.sdpa and len(self.softmax) == 1:
            found = self.softmax[0].to(torch.promote_types(self.softmax[0].dtype, torch.float32))
        else:
            raise InvalidTypeError(
                f"capture_attention: {path!r} ({class_name(module)}) made {len(self.sdpa)} attention call(s) and "
                f"{len(self.softmax)} softmax(es) in one forward, not one: its map is ambiguous"
            )
        if found.dim() < 3:
            raise InvalidTypeError(f"capture_attention: {path!r} ({class_name(module)}) attends without a token axis")
        return folded(module, found)


def _over_last_axis(out: Tensor, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    return isinstance(dim, int) and dim % max(out.dim(), 1) == out.dim() - 1


class AttentionMaps(Mapping[str, Tensor]):
    """The maps of the last forward inside ``capture_attention``: module path (``path_k`` for its call k) ->
    ``(batch, heads, queries, keys)`` float tensor, in module order. Each forward replaces them all.

    Examples:
        >>> import torch
        >>> from featurehooks import AttentionMaps, capture_attention
        >>> mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
        >>> x = torch.rand(1, 5, 8)
        >>> with capture_attention(mha) as maps:
        ...     _ = mha(x, x, x, need_weights=False)
        >>> isinstance(maps, AttentionMaps), list(maps), tuple(maps[""].shape)
        (True, [''], (1, 2, 5, 5))
    """

    def __init__(self, chosen: Mapping[str, nn.Module]) -> None:
        self._chosen = dict(chosen)
        self._maps: dict[str, Tensor] = {}

    def _publish(self, maps: dict[str, Tensor]) -> None:
        self._maps = maps

    def __getitem__(self, name: str) -> Tensor:
        if name in self._maps:
            return self._maps[name]
        if name in self._chosen:
            raise LayerNotRunError(f"attention module {name!r} did not run in the last forward")
        raise LayerNotFoundError(f"no attention map {name!r}; {did_you_mean(name, [*self._maps, *self._chosen])}")

    def __iter__(self) -> Iterator[str]:
        return iter(self._maps)

    def __len__(self) -> int:
        return len(self._maps)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{name!r}: {tuple(value.shape)}" for name, value in self._maps.items())
        return f"AttentionMaps({{{shapes}}})"


class _Forward:
    """One forward seen by the capture: its maps so far and the recorders of the calls in progress."""

    def __init__(self) -> None:
        self.maps: dict[str, Tensor] = {}
        self.recorders: dict[tuple[str, int], _Recorder] = {}


class _Capture(Observer[_Forward]):
    """Reads the map of every chosen call; the recorders this thread pushed are held in ``_local.pushed``."""

    wants_inputs = True

    def __init__(self, maps: AttentionMaps) -> None:
        self.maps = maps
        self._local = threading.local()

    def pushed(self) -> list[_Recorder]:
        """This thread's recorders on torch's mode stack, innermost last."""
        if not hasattr(self._local, "pushed"):
            self._local.pushed = []
        stack: list[_Recorder] = self._local.pushed
        return stack

    def pop(self, recorder: _Recorder | None = None) -> None:
        """Take ``recorder`` and those pushed after it (None: all of this thread's) off torch's mode stack."""
        stack = self.pushed()
        while stack and (recorder is None or recorder in stack):
            _remove_mode(stack.pop())

    def start(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Forward:
        self.pop()  # a forward a KeyboardInterrupt stopped inside an attention module (its hooks never ran)
        forward = _Forward()
        self.maps._publish(forward.maps)  # filled call by call: an early exit (an extractor's) keeps what ran
        return forward

    def before(
        self, state: _Forward, path: str, call: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if attention_kind(module) == MHA:
            state.maps[call_name(path, call)] = mha_weights(module, args, kwargs)  # type: ignore[arg-type]
            return
        recorder = _Recorder(module)
        recorder.__enter__()
        self.pushed().append(recorder)
        state.recorders[(path, call)] = recorder

    def after(
        self, state: _Forward, path: str, call: int, module: nn.Module, args: tuple[Any, ...], output: Any
    ) -> None:
        recorder = state.recorders.pop((path, call), None)
        if recorder is not None:
            self.pop(recorder)
            state.maps[call_name(path, call)] = recorder.weights(path, module)


def _remove_mode(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off this thread's torch-function mode stack, leaving the modes entered after it in place.

    ``TorchFunctionMode.__exit__`` pops whatever mode is on top: after a KeyboardInterrupt inside an attention module
    (whose always-called hooks run for an ``Exception`` only) the user may have entered a mode of their own above the
    recorder, which that would remove instead. Torch has no public call for this; its mode-stack functions are used.
    """
    above = []
    while torch._C._len_torch_function_stack():
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)


class _PopOnExit(InertInCopies):
    """Forward hook that also runs after an exception: takes the recorder of a call that raised off the mode stack
    (a call that returned was taken off by ``_Capture.after`` already)."""

    def __init__(self, capture: _Capture) -> None:
        self.capture = capture

    def __call__(self, module: nn.Module, _args: tuple[Any, ...], _output: Any) -> None:
        mine = [recorder for recorder in self.capture.pushed() if recorder.module is module]
        if mine:
            self.capture.pop(mine[-1])


def _supported_paths(model: nn.Module) -> list[str]:
    """Every attention module of ``model``, refusing the whole request when one of them cannot be read."""
    paths = attention_modules(model)
    if not paths:
        raise InvalidValueError(
            f"capture_attention: {type(model).__name__} has no attention module that featurehooks knows "
            "(timm ViT-style and Swin-style attention, torchvision's ViT, Swin and MaxViT, Hugging Face vision "
            "transformers, nn.MultiheadAttention)"
        )
    for path in paths:
        _check_kind(model, path)
    return paths


def _check_kind(model: nn.Module, path: str) -> None:
    module = model.get_submodule(path)
    if attention_kind(module) is None:
        raise InvalidTypeError(
            f"capture_attention: {path!r} is a {class_name(module)}, whose map cannot be read: {refusal(module)}; "
            "pass layers= naming the attention modules to capture (list_layers marks them)"
        )


@contextmanager
def capture_attention(model: nn.Module, layers: str | Sequence[str] | None = None) -> Iterator[AttentionMaps]:
    """Record the post-softmax attention weights of ``model``'s attention modules in each forward inside the block.

    The modules keep their fused kernels and the model's outputs are bitwise unchanged: each map is recomputed from
    the module's own query, key, scale and mask (relative position bias, shift mask, rope, prefix tokens included),
    or kept from its own softmax where it runs unfused. Each forward refills the yielded mapping; the hooks are
    removed when the block ends, also on error.

    Args:
        model: the model to read (timm ViT, DeiT, DINOv2, EVA, BEiT, CaiT, PiT, Twins, PVT v2, Swin v1/v2,
            LeViT, TNT, TinyViT, GCViT, CrossViT, EfficientFormer, MaxViT/CoAtNet, MViT v2, XCiT's class
            attention...; torchvision's VisionTransformer, Swin and MaxViT; Hugging Face ViT, DINOv2, CLIP, SigLIP,
            BEiT, Swin...; any ``nn.MultiheadAttention``; ``docs/analysis.md`` lists them), or a
            ``FeatureExtractor``: its backbone, under the backbone's module paths (the extractor's early exit
            leaves the blocks after its deepest layer without maps).
        layers: module paths, aliases or glob patterns of attention modules (``path_k``: call k only); ``None``
            takes every attention module, and fails if one of them is of a kind featurehooks cannot read.

    Shape:
        Each map is ``(batch, heads, queries, keys)``, detached, in float32 (float64 for a float64 model). Window
        attention (Swin, Twins' locally-grouped attention) folds the windows into the batch axis, as the module
        computes them: ``(batch * windows, heads, window tokens, window tokens)``. CaiT's talking-heads attention
        gives its softmax, before the heads are mixed again.

    Raises:
        LayerNotFoundError: an unknown layer name (with the closest names).
        InvalidTypeError: a chosen module whose map featurehooks cannot read (named with its class and why), or a
            TorchScript model.
        InvalidValueError: ``layers=None`` on a model without attention modules.

    Examples:
        >>> import torch, torchvision
        >>> from featurehooks.attention import capture_attention
        >>> vit = torchvision.models.VisionTransformer(32, 8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32)
        >>> with torch.no_grad(), capture_attention(vit.eval()) as maps:
        ...     logits = vit(torch.rand(3, 3, 32, 32))
        >>> [tuple(value.shape) for value in maps.values()]  # 16 patches and the class token, 2 heads
        [(3, 2, 17, 17), (3, 2, 17, 17)]
        >>> list(maps)[0]
        'encoder.layers.encoder_layer_0.self_attention'
    """
    if isinstance(model, FeatureExtractor):
        model = model.backbone
    refuse_torchscript(model, (), "capture_attention")
    selection = select_modules(model, layers, default=_supported_paths, what="capture attention of")
    for path in selection.paths:
        _check_kind(model, path)
    refuse_torchscript(model, selection.paths, "capture_attention")
    maps = AttentionMaps({path: model.get_submodule(path) for path in selection.paths})
    capture = _Capture(maps)
    session = ObserverSession(model, selection, capture)
    try:
        for path in selection.paths:
            module = model.get_submodule(path)
            session.adopt(module.register_forward_hook(_PopOnExit(capture), always_call=True))
        yield maps
    finally:
        session.remove()
        capture.pop()


def attention_rollout(
    maps: Mapping[str, Tensor] | Sequence[Tensor],
    *,
    head_fusion: HeadFusion = "mean",
    prefix_tokens: int | None = None,
) -> Tensor:
    """Attention rollout (Abnar & Zuidema, 2020): how much each token draws on each input token across the layers.

    Each layer's heads are fused (``head_fusion``: mean, max or min), the identity is added for the residual
    connection and the rows renormalized; the layers are multiplied from the first to the last
    (``R = Â_L ⋯ Â_1``). With ``prefix_tokens=p`` (the class token first, then registers), the class token's row
    over the ``N - p`` other tokens is returned: the saliency map that reshapes to the patch grid.

    Args:
        maps: ``(batch, heads, tokens, tokens)`` maps in layer order (``capture_attention``'s mapping is).
        head_fusion: how the heads of one layer become one map.
        prefix_tokens: leading non-patch tokens (class, registers, distillation); None returns the whole matrix.

    Shape:
        ``(batch, tokens, tokens)``, or ``(batch, tokens - prefix_tokens)`` with ``prefix_tokens``.

    References:
        Abnar & Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020.

    Examples:
        >>> import torch
        >>> from featurehooks.attention import attention_rollout
        >>> maps = [torch.rand(2, 3, 5, 5).softmax(-1) for _ in range(4)]
        >>> tuple(attention_rollout(maps).shape), tuple(attention_rollout(maps, prefix_tokens=1).shape)
        ((2, 5, 5), (2, 4))
    """
    layers = list(maps.items()) if isinstance(maps, Mapping) else [(f"maps[{k}]", m) for k, m in enumerate(maps)]
    if not layers:
        raise InvalidValueError("attention_rollout: no attention maps given")
    if head_fusion not in ("mean", "max", "min"):
        raise InvalidValueError(f"attention_rollout: head_fusion must be 'mean', 'max' or 'min', not {head_fusion!r}")
    first = layers[0][1]
    for name, layer in layers:
        if (
            layer.dim() != 4
            or layer.shape[-1] != layer.shape[-2]
            or (layer.shape[0], layer.shape[-1])
            != (
                first.shape[0],
                first.shape[-1],
            )
        ):
            raise InvalidValueError(
                f"attention_rollout: {name} has shape {tuple(layer.shape)}; rollout needs (batch, heads, tokens, "
                f"tokens) maps of one batch and token count, as {tuple(first.shape)} (not windows, class attention "
                "or spatial reduction)"
            )
    tokens = first.shape[-1]
    if prefix_tokens is not None and not 0 < prefix_tokens < tokens:
        raise InvalidValueError(f"attention_rollout: prefix_tokens must be in 1..{tokens - 1}, not {prefix_tokens}")
    eye = torch.eye(tokens, dtype=first.dtype, device=first.device)
    rollout = eye.expand(first.shape[0], tokens, tokens)
    for _, layer in layers:
        fused = layer.mean(1) if head_fusion == "mean" else getattr(layer, head_fusion)(1).values
        step = fused + eye
        rollout = (step / step.sum(-1, keepdim=True)) @ rollout
    return rollout if prefix_tokens is None else rollout[:, 0, prefix_tokens:]
