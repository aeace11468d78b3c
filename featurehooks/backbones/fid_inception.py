"""``"fid_inception"``: the TensorFlow Inception network of FID, as pytorch-fid ports it, with its weights file.

FID (Heusel et al., 2017) is computed on the 2048 features of the pool layer of
the Inception graph TensorFlow published in 2015 (``inception-2015-12-05``). pytorch-fid ported that
graph to PyTorch: torchvision's Inception-v3 with 1008 classes and three kinds of blocks patched
where TensorFlow computes otherwise (the average pools of the 35x35, 17x17 and first 8x8 blocks leave
the zero padding out of their means; the last 8x8 block max-pools its pool branch), and the weights
file ``pt_inception-2015-12-05-6726825d.pth``. This module builds the same network under the same
state-dict names, so that one file serves both: featurehooks reads it from the torch hub cache, where
pytorch-fid's own download puts it, always with ``weights_only=True``.

The model resizes its input to 299x299 itself and scales it from [0, 1] to [-1, 1], by default exactly as
pytorch-fid's ``InceptionV3`` does (bilinear, ``align_corners=False``, no antialiasing); its ``lineage``
picks one of the three preprocessings papers use (``_fid_resize.LINEAGES``: ``"legacy_pytorch"``,
``"legacy_tensorflow"``, ``"clean"``). Its preprocessing is therefore empty: no resize, crop or normalization
outside the model, and every image enters at its own size, which each lineage's resize needs to see.
"""

from __future__ import annotations

import os
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models import WeightsEnum
from torchvision.models.inception import (
    BasicConv2d,
    Inception3,
    InceptionA,
    InceptionAux,
    InceptionB,
    InceptionC,
    InceptionD,
    InceptionE,
)

from ._fid_resize import DEFAULT_LINEAGE, check_lineage, fid_input
from ._files import (
    hub_checkpoint_path,
    is_state_dict_file,
    load_hub_checkpoint,
    read_state_dict,
    weights_source,
)
from ._meta import adopt_state, meta_parameters
from .base import Backbone, Preprocessing

__all__ = [
    "FID_INCEPTION",
    "FID_WEIGHTS_URL",
    "FIDInceptionV3",
    "fid_inception_architecture",
    "fid_weights_path",
    "load_fid_inception",
]

FID_INCEPTION = "fid_inception"
"""The name ``load_backbone`` and ``FeatureExtractor`` build the FID Inception network by.

Examples:
    >>> from featurehooks import list_layers
    >>> from featurehooks.backbones.fid_inception import FID_INCEPTION
    >>> row = list_layers(FID_INCEPTION, include=["avgpool"])[0]  # pool3: the 2048 FID features
    >>> row.name, row.channels
    ('avgpool', 2048)
"""

FID_WEIGHTS_URL = (
    "https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/pt_inception-2015-12-05-6726825d.pth"
)
"""Where pytorch-fid publishes the weights file; featurehooks reads it from the hub cache (``fid_weights_path()``).

Examples:
    >>> from featurehooks.backbones.fid_inception import FID_WEIGHTS_URL
    >>> FID_WEIGHTS_URL.rsplit("/", 1)[-1]
    'pt_inception-2015-12-05-6726825d.pth'
"""

_WEIGHTS_NAME = "pt_inception-2015-12-05-6726825d"  # what a Backbone and statistics record for weights="DEFAULT"
_CLASSES = 1008  # the logits of TensorFlow's graph (torchvision's Inception-v3 has 1000)
_IN_CHANNELS = 3
_WHAT = "fid_inception (pytorch-fid's port of TensorFlow's FID Inception)"

WeightsArg = Union[str, "os.PathLike[str]", WeightsEnum, None]  # an enum member is refused, with the reason


def _pool_without_padding(x: Tensor) -> Tensor:
    """TensorFlow's 3x3 average pool with "SAME" padding: the padded zeros are not counted in the mean."""
    return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)


def _max_pool(x: Tensor) -> Tensor:
    """The pool branch of the last 8x8 block of TensorFlow's graph: a 3x3 max pool, not an average."""
    return F.max_pool2d(x, kernel_size=3, stride=1, padding=1)


class _FIDInceptionA(InceptionA):
    """A 35x35 block (``Mixed_5b`` to ``Mixed_5d``) whose pool branch averages without the padding."""

    def _forward(self, x: Tensor) -> list[Tensor]:
        five = self.branch5x5_2(self.branch5x5_1(x))
        double = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return [self.branch1x1(x), five, double, self.branch_pool(_pool_without_padding(x))]


class _FIDInceptionC(InceptionC):
    """A 17x17 block (``Mixed_6b`` to ``Mixed_6e``) whose pool branch averages without the padding."""

    def _forward(self, x: Tensor) -> list[Tensor]:
        seven = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        double = x
        for conv in (
            self.branch7x7dbl_1,
            self.branch7x7dbl_2,
            self.branch7x7dbl_3,
            self.branch7x7dbl_4,
            self.branch7x7dbl_5,
        ):
            double = conv(double)
        return [self.branch1x1(x), seven, double, self.branch_pool(_pool_without_padding(x))]


class _FIDInceptionE(InceptionE):
    """An 8x8 block whose pool branch is TensorFlow's: an average without the padding (``Mixed_7b``) or a max
    (``Mixed_7c``)."""

    def __init__(self, in_channels: int, *, max_pool: bool, **kwargs: Any) -> None:
        super().__init__(in_channels, **kwargs)
        self.max_pool = max_pool

    def _forward(self, x: Tensor) -> list[Tensor]:
        single = self.branch3x3_1(x)
        three = torch.cat([self.branch3x3_2a(single), self.branch3x3_2b(single)], 1)
        double = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        three_double = torch.cat([self.branch3x3dbl_3a(double), self.branch3x3dbl_3b(double)], 1)
        pooled = _max_pool(x) if self.max_pool else _pool_without_padding(x)
        return [self.branch1x1(x), three, three_double, self.branch_pool(pooled)]


def _fid_inception_e(in_channels: int, **kwargs: Any) -> _FIDInceptionE:
    """The 8x8 block Inception3 builds for ``in_channels``: 1280 is ``Mixed_7b``, 2048 the last, ``Mixed_7c``."""
    return _FIDInceptionE(in_channels, max_pool=in_channels == 2048, **kwargs)


class FIDInceptionV3(Inception3):
    """TensorFlow's FID Inception (pytorch-fid's port): torchvision's Inception-v3 with 1008 classes, TensorFlow's
    pools, and the resize to 299 and the scaling to [-1, 1] inside ``forward``.

    Module names and state-dict keys are torchvision's (``Conv2d_1a_3x3`` ... ``Mixed_7c``, ``avgpool``,
    ``fc``), which are also the keys of pytorch-fid's weights file. The FID features are the output of
    ``avgpool`` (TensorFlow's ``pool_3``), ``(B, 2048, 1, 1)``; pytorch-fid's other blocks are the outputs of
    ``maxpool1`` (64), ``maxpool2`` (192) and ``Mixed_6e`` (768). ``forward`` returns the 1008 logits of ``fc``.

    ``lineage`` is the preprocessing inside ``forward`` (``"legacy_pytorch"`` unless set): assigning another
    name switches it, and a bad name is refused with the closest ones (``fid_extractor(mode=...)`` sets it).

    Built directly, it has random weights (the architecture's own init with ``init_weights=True``): that is not
    the FID network. ``load_backbone("fid_inception")`` loads the weights file.

    Args:
        init_weights: initialize the weights as torchvision's Inception-v3 does (``False``: leave them as
            ``nn.Module`` creates them, to be overwritten by a state dict).
        lineage: the FID lineage whose resize and scaling ``forward`` applies.

    Shape:
        input: ``(B, 3, H, W)`` in [0, 1], any ``H``, ``W`` (resized to 299 inside); output: ``(B, 1008)``.

    Examples:
        >>> import torch
        >>> from featurehooks.backbones.fid_inception import FIDInceptionV3
        >>> _ = torch.manual_seed(0)
        >>> model = FIDInceptionV3().eval()  # random weights: not the FID network
        >>> model(torch.rand(1, 3, 32, 48)).shape
        torch.Size([1, 1008])

    References:
        Szegedy, Vanhoucke, Ioffe, Shlens, Wojna (2016). Rethinking the Inception Architecture for Computer
        Vision. CVPR.
        Heusel, Ramsauer, Unterthiner, Nessler, Hochreiter (2017). GANs Trained by a Two Time-Scale Update
        Rule Converge to a Local Nash Equilibrium. NeurIPS.
        Seitzer (2020). pytorch-fid: FID Score for PyTorch. https://github.com/mseitzer/pytorch-fid
    """

    def __init__(self, *, init_weights: bool = True, lineage: str = DEFAULT_LINEAGE) -> None:
        blocks = [BasicConv2d, _FIDInceptionA, InceptionB, _FIDInceptionC, InceptionD, _fid_inception_e, InceptionAux]
        super().__init__(
            num_classes=_CLASSES,
            aux_logits=False,
            transform_input=False,
            inception_blocks=blocks,  # type: ignore[arg-type]  # a factory for the 8x8 blocks
            init_weights=init_weights,
        )
        self.lineage = lineage

    @property
    def lineage(self) -> str:
        """The FID lineage of the resize and scaling in ``forward``: one of ``_fid_resize.LINEAGES``."""
        return self._lineage

    @lineage.setter
    def lineage(self, name: str) -> None:
        self._lineage = check_lineage(name)

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]  # logits only: there is no auxiliary head
        logits, _ = self._forward(fid_input(x, self._lineage))
        return logits


def fid_weights_path() -> str:
    """Where the weights file is read from: ``$TORCH_HOME/hub/checkpoints/pt_inception-2015-12-05-6726825d.pth``.

    pytorch-fid's own download (``python -m pytorch_fid``, or ``pytorch_fid.inception.fid_inception_v3()``)
    puts the file there too; without a network, copy it there (or pass the file as ``weights=``).

    Examples:
        >>> from featurehooks.backbones.fid_inception import fid_weights_path
        >>> fid_weights_path().endswith("hub/checkpoints/pt_inception-2015-12-05-6726825d.pth")
        True
    """
    return str(hub_checkpoint_path(FID_WEIGHTS_URL))


def _source(weights: object) -> str | None:
    """What a Backbone records for ``weights``: None, the local file, or the checkpoint's name for "DEFAULT"."""
    return weights_source(
        weights,
        _WEIGHTS_NAME,
        f"unknown weights {weights!r} for {FID_INCEPTION}: it has one set of weights, 'DEFAULT' (pytorch-fid's "
        f"{_WEIGHTS_NAME}.pth from the torch hub cache); or pass a local .pth file, or None for random init "
        "(not the FID network)",
    )


def _preprocessing() -> Preprocessing:
    """None: the model resizes and scales its input itself, as pytorch-fid's InceptionV3 does."""
    return Preprocessing()


def fid_inception_architecture(weights: WeightsArg = "DEFAULT") -> Backbone:
    """``load_fid_inception(weights)`` with its parameters on the meta device: nothing read or initialized.

    Examples:
        >>> from featurehooks.backbones.fid_inception import fid_inception_architecture
        >>> backbone = fid_inception_architecture()
        >>> backbone.weights, next(backbone.model.parameters()).device
        ('pt_inception-2015-12-05-6726825d', device(type='meta'))
    """
    source = _source(weights)
    with meta_parameters():
        model = FIDInceptionV3(init_weights=False)
    return Backbone(model, FID_INCEPTION, source, _preprocessing(), _IN_CHANNELS)


def load_fid_inception(weights: WeightsArg = "DEFAULT") -> Backbone:
    """The FID Inception with its weights: ``"DEFAULT"`` (the file in the torch hub cache), a local file, or None.

    ``"DEFAULT"`` reads ``fid_weights_path()``, downloading it first from ``FID_WEIGHTS_URL`` where it is
    missing and a network is there; a local ``.pth`` is read as it is. Both with ``weights_only=True``: no
    pickled code runs. ``None`` is a random init: the architecture, not the FID network.

    Raises:
        WeightsUnavailableError: the file is neither cached nor downloadable (the message names the file,
            the folder and the URL), unreadable, or not this network's weights; or ``weights`` is another name.

    Examples:
        >>> import torch
        >>> from featurehooks.backbones.fid_inception import load_fid_inception
        >>> _ = torch.manual_seed(0)
        >>> backbone = load_fid_inception(weights=None)  # random init; "DEFAULT" reads pytorch-fid's file
        >>> backbone.name, backbone.weights, backbone.preprocessing.resize_size
        ('fid_inception', None, None)
    """
    source = _source(weights)
    if weights is None:
        return Backbone(FIDInceptionV3(), FID_INCEPTION, None, _preprocessing(), _IN_CHANNELS)
    if is_state_dict_file(weights):
        state = read_state_dict(weights)  # type: ignore[arg-type]
    else:
        alternatives = (
            f"download it from {FID_WEIGHTS_URL} (pytorch-fid's download puts it there too), or pass "
            f"weights='path/to/{_WEIGHTS_NAME}.pth', or weights=None for random init (not the FID network)"
        )
        state = load_hub_checkpoint(FID_WEIGHTS_URL, _WHAT, alternatives)
    return Backbone(_with_state(state, str(source)), FID_INCEPTION, source, _preprocessing(), _IN_CHANNELS)


def _with_state(state: dict[str, Tensor], source: str) -> nn.Module:
    """The network built on the meta device, adopting ``state``'s tensors in the architecture's dtypes."""
    with meta_parameters():
        model = FIDInceptionV3(init_weights=False)
    return adopt_state(model, state, source, FID_INCEPTION)
