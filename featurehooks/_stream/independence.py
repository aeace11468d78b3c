"""Whether each row a model returns depends on its own image only: what lets the pipeline cut a batch in pieces.

Cutting a batch (CPU micro-batches, ``tiling``) leaves every row as one forward of the batch gives it only for a
model whose rows never see the other images of their batch. That is proved, not assumed: the model is in eval
mode, and every module in it is either a ``torch.nn`` module of a per-sample kind (convolutions, linear layers,
activations, pooling, padding, resampling, LayerNorm/GroupNorm/InstanceNorm/RMSNorm, dropout, BatchNorm with
running statistics, containers; ``dim`` arguments that never name the batch axis) or a class of torchvision, timm
or featurehooks' backbones, whose forwards keep the rows of a batch apart in eval mode (their children are
checked too).
Anything else (a module with a forward of its own, BatchNorm without running statistics, ``Flatten(0)``,
``Softmax(dim=0)``) or a forward hook other than the extractor's own (it would run once per piece) is not
proved independent, and its batches run in one forward.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules import activation, conv, dropout, instancenorm, padding, pooling
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

__all__ = ["rows_independent"]

_PER_SAMPLE: tuple[type[nn.Module], ...] = (
    nn.Sequential,
    nn.ModuleList,
    nn.ModuleDict,
    nn.Identity,
    conv._ConvNd,
    nn.Linear,
    nn.Bilinear,
    *(getattr(activation, name) for name in activation.__all__ if name not in ("MultiheadAttention", "Softmax2d")),
    pooling._MaxPoolNd,
    pooling._AvgPoolNd,
    pooling._AdaptiveAvgPoolNd,
    pooling._AdaptiveMaxPoolNd,
    pooling._LPPoolNd,
    padding._ConstantPadNd,
    padding._ReflectionPadNd,
    padding._ReplicationPadNd,
    padding._CircularPadNd,
    nn.Upsample,
    nn.PixelShuffle,
    nn.PixelUnshuffle,
    nn.ChannelShuffle,
    nn.Flatten,
    nn.Unflatten,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.RMSNorm,
    instancenorm._InstanceNorm,
    dropout._DropoutNd,
    _BatchNorm,
)
_LIBRARIES = ("torchvision.", "timm.", "featurehooks.backbones.")  # forwards that keep rows apart in eval mode
_OUR_HOOKS = "featurehooks._tap_session"  # the extractor's taps and max pools: per image, whatever the batch


def rows_independent(model: nn.Module) -> bool:
    """Whether every row of ``model``'s output provably depends on the matching image of the batch alone (see the
    module docstring); ``False`` where that cannot be shown, and the batch then runs in one forward."""
    if _global_forward_hooks or _global_forward_pre_hooks:
        return False
    return all(_per_sample(module) for module in model.modules())


def _per_sample(module: nn.Module) -> bool:
    if module.training or not _only_our_hooks(module):
        return False
    if isinstance(module, _BatchNorm) and (not module.track_running_stats or module.running_mean is None):
        return False  # normalized with the batch's own statistics, even in eval mode
    kind = type(module)
    if kind.__module__.startswith(_LIBRARIES):
        return True
    return kind.__module__.startswith("torch.nn.") and isinstance(module, _PER_SAMPLE) and _keeps_batch_axis(module)


def _keeps_batch_axis(module: nn.Module) -> bool:
    """Whether a module that takes a ``dim`` leaves the batch axis alone: axis 0 of tensors of two axes or more
    (what a per-sample module gives a per-sample one), so a positive axis or the last one."""
    if isinstance(module, nn.Flatten):
        return module.start_dim >= 1
    if isinstance(module, nn.Unflatten):
        return module.dim >= 1
    if isinstance(module, (nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.GLU)):
        return module.dim is not None and (module.dim >= 1 or module.dim == -1)
    return True


def _only_our_hooks(module: nn.Module) -> bool:
    """No hook and no forward set on the instance (a patched ``module.forward``) but the extractor's own."""
    hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
    patched = module.__dict__.get("forward")
    if patched is not None:
        hooks = (*hooks, getattr(patched, "__func__", patched))
    return all(getattr(hook, "__module__", None) == _OUR_HOOKS for hook in hooks)
