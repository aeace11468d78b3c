"""FID: statistics of the TensorFlow Inception's pool features, in one of three lineages.

``fid_statistics`` streams images through the ``"fid_inception"`` backbone (pytorch-fid's port of the
TensorFlow graph and its weights file): every image enters at its own size and is resized to 299x299 and
scaled to [-1, 1] inside the model, as its ``mode`` (the FID lineage) says; the 2048 features of the pool
layer are summarized in a ``FeatureStatistics`` that records the lineage. By default (``"legacy_pytorch"``)
``frechet_distance`` of two such statistics is the number ``python -m pytorch_fid`` prints for the same
images; ``"legacy_tensorflow"`` is torch-fidelity's (and TensorFlow's, StyleGAN's, ADM's, EDM's), ``"clean"``
clean-fid's default. Statistics of two lineages refuse to be compared.

``load_mu_sigma`` reads the mean and covariance of any FID statistics file: pytorch-fid's ``--save-stats``
output, the precomputed ``.npz`` files of the original TensorFlow code (TTUR), or featurehooks' own.

Which FID is which (all use the weights of TensorFlow's 2015 Inception graph; their numbers still differ):

- ``mode="legacy_pytorch"`` (pytorch-fid; the default of ``fid_statistics`` and ``featurehooks fid``): images
  in [0, 1] resized to 299 by ``F.interpolate(..., mode="bilinear", align_corners=False)`` (half-pixel
  centers, no antialiasing), then scaled by ``2x - 1``.
- ``mode="legacy_tensorflow"`` (torch-fidelity, clean-fid's ``legacy_tensorflow``, StyleGAN, ADM, EDM):
  ``uint8`` levels resized by TensorFlow 1's bilinear rule (source = destination x in / out: no half-pixel
  offset), then scaled by ``(x - 128) / 128``; floats are rounded to levels first. torchmetrics'
  ``FrechetInceptionDistance`` is this lineage, but truncates floats with ``(x * 255).byte()``.
- ``mode="clean"`` (clean-fid's default): levels 0..255 resized by Pillow's bicubic filter on each channel in
  float32 (antialiased when downscaling), clipped to [0, 255], then scaled by ``(x - 128) / 128``.
- ``featurehooks fd --backbone inception_v3``: torchvision's Inception-v3 and ImageNet preprocessing: a
  Fréchet distance, not FID.

The resize of each lineage runs inside the network (``FIDInceptionV3.lineage``), not in the input pipeline:
it must see each image at its own size, and the pipeline's resizes are torchvision's and Pillow's ``uint8``
ones, none of which is TensorFlow 1's or clean-fid's float bicubic.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any, Literal, Union

import numpy as np
import torch
from torch import Tensor
from typing_extensions import Unpack

from ..backbones._fid_resize import LINEAGES, check_lineage
from ..backbones.fid_inception import FID_INCEPTION, FIDInceptionV3
from ..errors import InvalidValueError
from ._npz import Header, Mismatch, read_npz
from ._reuse import given_or_built
from .collect import PassSettings, collect
from .statistics import FeatureStatistics

if TYPE_CHECKING:
    from .._stream import SourceSpec, StreamOptions
    from ..extractor import FeatureExtractor, Precision

__all__ = [
    "FID_LAYERS",
    "FID_MODES",
    "FIDMode",
    "fid_extractor",
    "fid_mode",
    "fid_network",
    "fid_statistics",
    "load_mu_sigma",
]

FIDMode = Literal["legacy_pytorch", "legacy_tensorflow", "clean"]
"""The name of a FID lineage: the resize and scaling before the FID Inception (see the module's docstring).

Examples:
    >>> from typing import get_args
    >>> from featurehooks.metrics import FIDMode
    >>> get_args(FIDMode)
    ('legacy_pytorch', 'legacy_tensorflow', 'clean')
"""

FID_MODES: tuple[str, ...] = LINEAGES
"""The FID lineages by name, pytorch-fid's (the default) first.

Examples:
    >>> from featurehooks.metrics.fid import FID_MODES
    >>> FID_MODES
    ('legacy_pytorch', 'legacy_tensorflow', 'clean')
"""

FID_LAYERS = {64: "maxpool1", 192: "maxpool2", 768: "Mixed_6e", 2048: "avgpool"}
"""The layer of ``"fid_inception"`` whose average-pooled output has ``dims`` features, by ``dims``: pytorch-fid's
``--dims`` blocks. 2048 (``avgpool``, TensorFlow's ``pool_3``) is FID; the others are only comparable with
themselves.

Examples:
    >>> from featurehooks.metrics import FID_LAYERS
    >>> FID_LAYERS[2048]
    'avgpool'
"""

WeightsArg = Union[str, "os.PathLike[str]", None]
_DEFAULT_DIMS = 2048


def _check_dims(dims: object) -> str:
    if isinstance(dims, bool) or dims not in FID_LAYERS:
        raise InvalidValueError(f"dims must be one of {sorted(FID_LAYERS)} (pytorch-fid's --dims), got {dims!r}")
    return FID_LAYERS[dims]  # type: ignore[index]


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def fid_extractor(
    weights: WeightsArg = "DEFAULT",
    *,
    dims: int = _DEFAULT_DIMS,
    mode: FIDMode = "legacy_pytorch",
    device: str | torch.device | None = None,
    **extractor_options: Any,
) -> FeatureExtractor:
    """A ``FeatureExtractor`` of the FID Inception's layer of ``dims`` features, on ``device``, without a graph.

    It computes in NCHW and float32, as pytorch-fid does (``memory_format="contiguous"``,
    ``precision="float32"``); ``extractor_options`` change that as for any extractor. ``mode`` is the FID
    lineage: the resize to 299 and the scaling the network applies to each image, at its own size.

    Args:
        weights: ``"DEFAULT"`` (pytorch-fid's ``pt_inception-2015-12-05-6726825d.pth``, read from the torch hub
            cache), a local copy of that file, or ``None`` for random init (the architecture, not the FID network).
        dims: 2048 for FID (the pool layer), or 64, 192, 768 for pytorch-fid's earlier blocks (``FID_LAYERS``).
        mode: ``"legacy_pytorch"`` (pytorch-fid), ``"legacy_tensorflow"`` (torch-fidelity, TensorFlow, StyleGAN,
            ADM, EDM) or ``"clean"`` (clean-fid); ``FID_MODES``. ``"clean"`` resizes with Pillow on the CPU and
            passes no gradient.
        device: where it computes; ``None``: CUDA when available, else the CPU (as pytorch-fid chooses).
        **extractor_options: ``FeatureExtractor`` keyword arguments, e.g. ``precision="bf16"`` (faster, but not
            the number papers report) or ``memory_format="auto"``.

    Shape:
        input: ``(B, 3, H, W)`` in [0, 1], any size; output: ``{layer: (B, dims, h, w)}`` (1x1 for 2048).

    Raises:
        InvalidValueError: ``dims`` is not a pytorch-fid block, or ``mode`` no lineage (with the closest names).

    Examples:
        >>> import torch
        >>> from featurehooks.metrics.fid import fid_extractor, fid_mode
        >>> _ = torch.manual_seed(0)
        >>> ext = fid_extractor(weights=None, mode="clean", device="cpu")  # random init: not the FID network
        >>> {name: tuple(value.shape) for name, value in ext(torch.rand(2, 3, 40, 60)).items()}
        {'avgpool': (2, 2048, 1, 1)}
        >>> fid_mode(ext)
        'clean'
    """
    return inception_extractor([_check_dims(dims)], weights, mode, device, extractor_options)


def inception_extractor(
    layers: list[str], weights: WeightsArg, mode: str, device: str | torch.device | None, options: dict[str, Any]
) -> FeatureExtractor:
    """A ``FeatureExtractor`` of ``layers`` of the FID Inception in the lineage ``mode``, as ``fid_extractor`` builds
    it (the FID metrics' one definition of their network)."""
    from ..extractor import FeatureExtractor

    check_lineage(mode)
    # NCHW, as pytorch-fid computes: the same statistics to 1e-16. "auto" picks channels-last for large images on
    # the CPU, with FIDs 3e-7 apart (measured on 512x512 photos) and no measured gain in speed
    options = {"mode": "detach", "memory_format": "contiguous", **options}
    extractor = FeatureExtractor(FID_INCEPTION, layers, weights=weights, **options)
    fid_network(extractor).lineage = mode  # the extractor's own copy of the network
    return extractor.to(_default_device() if device is None else device)


def fid_network(extractor: FeatureExtractor) -> FIDInceptionV3:
    """The FID Inception network an extractor of ``fid_extractor()`` runs (its ``fc`` serves the Inception Score).

    Raises:
        InvalidValueError: not an extractor of the FID Inception.

    Examples:
        >>> from featurehooks.metrics import fid_extractor, fid_network
        >>> fid_network(fid_extractor(weights=None, device="cpu")).fc.weight.shape  # the 1008 logits
        torch.Size([1008, 2048])
    """
    network = extractor.backbone
    if not isinstance(network, FIDInceptionV3):
        raise InvalidValueError(
            f"expected an extractor of {FID_INCEPTION!r} as fid_extractor() builds, got one of "
            f"{extractor.backbone_name!r} ({type(network).__name__})"
        )
    return network


def fid_mode(extractor: FeatureExtractor) -> str:
    """The FID lineage (``mode``) of a ``fid_extractor()``: the resize and scaling its network applies.

    Raises:
        InvalidValueError: not an extractor of the FID Inception.

    Examples:
        >>> from featurehooks.metrics import fid_extractor, fid_mode
        >>> fid_mode(fid_extractor(weights=None, mode="clean", device="cpu"))
        'clean'
    """
    return fid_network(extractor).lineage


def _layer_of(extractor: FeatureExtractor) -> str:
    """The FID layer ``extractor`` returns, refused unless it is a ``"fid_inception"`` extractor of one of them."""
    taps = list(extractor.taps)
    if extractor.backbone_name != FID_INCEPTION or len(taps) != 1 or taps[0].path not in FID_LAYERS.values():
        raise InvalidValueError(
            f"extractor= must return one FID layer of {FID_INCEPTION!r} ({', '.join(FID_LAYERS.values())}), as "
            f"fid_extractor() builds; this one is {extractor.backbone_name!r} with layers {extractor.layers}: use "
            "feature_statistics for other features"
        )
    return taps[0].name


def fid_statistics(
    source: SourceSpec,
    *,
    weights: WeightsArg = "DEFAULT",
    dims: int = _DEFAULT_DIMS,
    mode: FIDMode | None = None,
    device: str | torch.device | None = None,
    precision: Precision = "float32",
    extractor: FeatureExtractor | None = None,
    keep: int = 0,
    seed: int = 0,
    **options: Unpack[StreamOptions],
) -> FeatureStatistics:
    """FID statistics of an image collection, in the lineage ``mode``: by default pytorch-fid's
    ``calculate_activation_statistics``, streamed.

    ``feature_statistics`` of ``fid_extractor(weights, dims=dims, mode=mode, device=device)`` with no resize or
    crop outside the network: each image enters at its own size, and a batch of images of several sizes runs
    one forward per size (pytorch-fid stacks a batch, so it needs one size per batch). Mean and covariance
    are accumulated in float64 without keeping the features; they equal pytorch-fid's on the same files
    (measured on the CPU: the mean bitwise, the covariance to 1e-16 of its scale). Their origin records the
    lineage: statistics of two lineages refuse to be compared.

    Files are read as featurehooks reads them (``read_image``): the same pixels as pytorch-fid's
    ``Image.open(path).convert("RGB")`` for RGB and grayscale PNG and JPEG files, but EXIF orientation is
    applied and transparent pixels are composited on white (pytorch-fid ignores both), and folders are
    searched recursively, any suffix case (pytorch-fid lists a folder's own files with lower-case suffixes).

    Args:
        source: a folder (searched recursively), a glob, an image path, a list of these, a ``Dataset`` of image
            tensors or an ``(N, 3, H, W)`` tensor (floats in [0, 1], or ``uint8``), as ``feature_statistics`` takes.
        weights: see ``fid_extractor``.
        dims: see ``fid_extractor``.
        mode: the FID lineage (see ``fid_extractor``); ``None``: that of ``extractor``, else ``"legacy_pytorch"``.
        device: see ``fid_extractor``.
        precision: see ``fid_extractor``.
        extractor: a ``fid_extractor()`` to reuse (e.g. for two sets with one random init); it fixes weights,
            dims, mode, device and precision, which must then be left as they are (or ``mode`` equal to its).
        keep: also keep a sample of at most this many feature vectors (for ``kernel_inception_distance``).
        seed: seed of that sample.
        **options: the ``StreamOptions``; ``resize_size`` and ``crop_size`` default to the FID network's own:
            none outside the network.

    Returns:
        ``FeatureStatistics`` of ``(N, dims)`` vectors, their origin naming ``"fid_inception"``, the layer, the
        weights, the lineage and the preprocessing, so they are compared only with statistics of the same
        features.

    Raises:
        InvalidValueError: ``dims`` is not a pytorch-fid block, ``mode`` no lineage, ``extractor`` is no FID
            extractor or comes with ``weights``/``dims``/``device`` or another ``mode``, or bad options.
        WeightsUnavailableError: the weights file is neither cached nor downloadable, or unusable.
        InputNotFoundError: ``source`` finds no images.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics import fid_extractor, fid_statistics
        >>> _ = torch.manual_seed(0)
        >>> ext = fid_extractor(weights=None, device="cpu")  # random init: not the FID network ("DEFAULT" is)
        >>> real = fid_statistics(torch.rand(4, 3, 32, 32), extractor=ext)  # or folders, globs, file lists
        >>> fake = fid_statistics(torch.rand(4, 3, 48, 40), extractor=ext)  # another size: resized inside
        >>> real.count, real.dim, real.origin.layer
        (4, 2048, 'avgpool')

        ``frechet_distance(real, fake)`` is then the FID (of 10,000 or more images a set, as papers report it).

    References:
        Heusel, Ramsauer, Unterthiner, Nessler, Hochreiter (2017). GANs Trained by a Two Time-Scale Update
        Rule Converge to a Local Nash Equilibrium. NeurIPS.
        Seitzer (2020). pytorch-fid: FID Score for PyTorch. https://github.com/mseitzer/pytorch-fid
    """
    if mode is not None:
        check_lineage(mode)
    extractor = given_or_built(
        extractor,
        lambda: fid_extractor(weights, dims=dims, mode=mode or "legacy_pytorch", device=device, precision=precision),
        weights,
        device,
        precision,
        dims=dims != _DEFAULT_DIMS,
        mode=False,
    )
    layer = _layer_of(extractor)
    lineage = fid_mode(extractor)
    if mode is not None and mode != lineage:
        raise InvalidValueError(
            f"mode={mode!r}, but extractor= computes FID features of mode {lineage!r}: pass one of them, or "
            f"fid_extractor(..., mode={mode!r})"
        )
    return collect(extractor, source, [layer], PassSettings.of("avg", keep, seed, options))[layer]


def load_mu_sigma(path: str | os.PathLike[str], *, dims: int | None = None) -> tuple[Tensor, Tensor]:
    """The mean ``mu`` and covariance ``sigma`` of a FID statistics ``.npz`` file, as float64 tensors.

    Reads pytorch-fid's ``--save-stats`` files, the precomputed files of the original TensorFlow code
    (TTUR's ``fid_stats_*.npz``) and featurehooks' statistics files alike: any ``.npz`` with arrays ``mu``
    ``(D,)`` and ``sigma`` ``(D, D)``. No pickle is read, and nothing is unpacked before its size is known:
    ``D`` from the arrays' headers is checked against ``dims``, and the bytes they unpack to against the
    file's own size and a budget. Such a file records neither the count nor the network: ``frechet_distance``
    takes the pair as it is, with no check that it comes from the same features (``FeatureStatistics.load``
    keeps those of featurehooks' own files).

    Args:
        path: the file.
        dims: the number of features ``D`` expected (2048 for FID); ``None`` takes the file's.

    Shape:
        ``mu``: ``(D,)``; ``sigma``: ``(D, D)``.

    Raises:
        InputNotFoundError: no such file.
        InvalidValueError: not an ``.npz`` archive, no ``mu``/``sigma`` arrays, shapes that do not fit (or another
            ``D`` than ``dims``), values that are not finite real numbers.

    Examples:
        >>> import os, tempfile
        >>> import numpy as np
        >>> from featurehooks.metrics import frechet_distance, load_mu_sigma
        >>> path = os.path.join(tempfile.mkdtemp(), "ref.npz")
        >>> np.savez_compressed(path, mu=np.zeros(3), sigma=np.eye(3))  # as pytorch-fid --save-stats writes
        >>> mu, sigma = load_mu_sigma(path, dims=3)
        >>> tuple(sigma.shape), frechet_distance((mu, sigma), (mu + 1, sigma))
        ((3, 3), 3.0)
    """
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise InvalidValueError(f"dims must be an int >= 1 or None, got {dims!r}")
    arrays, _ = read_npz(path, "FID statistics file", ("mu", "sigma"), check=functools.partial(_check_mu_sigma, dims))
    mu, sigma = (np.asarray(arrays[name], dtype=np.float64) for name in ("mu", "sigma"))
    if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
        raise InvalidValueError(f"{os.fspath(path)} is not a FID statistics file: it holds NaN or infinite values")
    return torch.from_numpy(mu), torch.from_numpy(sigma)


def _check_mu_sigma(dims: int | None, headers: dict[str, Header], meta: object) -> None:
    """Refuse, before reading, headers that are not ``(D,)`` and ``(D, D)``, or of another ``D`` than ``dims``."""
    (mu_shape, _), (sigma_shape, _) = headers["mu"], headers["sigma"]
    if len(mu_shape) != 1 or not mu_shape[0] or sigma_shape != (mu_shape[0],) * 2:
        raise InvalidValueError(f"mu of shape {mu_shape} and sigma of shape {sigma_shape}: expected (D,) and (D, D)")
    found = mu_shape[0]
    if dims is not None and found != dims:
        hint = f"pass dims={found}" if found in FID_LAYERS else "they are not FID statistics"
        raise Mismatch(f"holds the statistics of {found} features, not dims={dims}: {hint}")
