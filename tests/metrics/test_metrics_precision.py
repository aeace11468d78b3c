"""Metrics on a ``precision="bf16"`` backbone: LPIPS and DISTS finite and close to float32 in values and input
gradients, statistics and torchmetrics features reduced in float32, the option forwarded by every builder."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from featurehooks import DISTS, LPIPS, feature_statistics
from featurehooks.errors import InvalidValueError
from featurehooks.metrics import PooledFeatures, fid_extractor, fid_statistics

from helpers import CASTS, bf16_anywhere, degraded_photos, needs_cpu_bf16, photos, tiny_extractor, value_and_grad


@pytest.fixture(scope="module")
def pair() -> tuple[torch.Tensor, torch.Tensor]:
    return degraded_photos()


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda **o: LPIPS("alex", reduction="none", **o), id="lpips-alex"),
        pytest.param(lambda **o: LPIPS("vgg", reduction="none", **o), id="lpips-vgg", marks=needs_cpu_bf16),
        pytest.param(lambda **o: DISTS(reduction="none", **o), id="dists", marks=needs_cpu_bf16),
    ],
)
@bf16_anywhere
def test_bf16_metrics_are_finite_and_close(lpips_trunks: None, pair, build: Callable[..., torch.nn.Module]) -> None:
    x, y = pair
    low, full = build(precision="bf16"), build()
    assert low.extractor.precision == "bf16" and "precision='bf16'" in repr(low)
    value, grad = value_and_grad(low, x, y)
    expected, expected_grad = value_and_grad(full, x, y)
    torch.testing.assert_close(value, expected, rtol=0.02, atol=0)
    assert torch.nn.functional.cosine_similarity(grad.flatten(), expected_grad.flatten(), dim=0) > 0.98


@bf16_anywhere
@pytest.mark.parametrize(
    "build",
    [lambda **o: LPIPS("alex", weights=None, **o), lambda **o: DISTS(weights=None, **o)],
    ids=["lpips", "dists"],
)
def test_casts_of_a_bf16_metric_leave_its_calibration(pair, build: Callable[..., torch.nn.Module]) -> None:
    """Under bf16 a cast only moves the metric, its calibration (LPIPS heads, DISTS alpha and beta) as its extractor:
    float32 and bitwise as built (they were rounded through float16 by ``.half().float()``). A float32 metric is cast
    whole."""
    metric = build(precision="bf16")
    calibration = {name: buffer.clone() for name, buffer in metric.named_buffers() if "extractor" not in name}
    assert calibration and all(buffer.dtype == torch.float32 for buffer in calibration.values())
    before = metric(*pair) if isinstance(metric, LPIPS) else None  # one forward: DISTS's trunk is VGG16
    for cast, apply in CASTS.items():
        apply(metric)
        for name, buffer in metric.named_buffers():
            if name in calibration:
                assert buffer.dtype == torch.float32 and torch.equal(buffer, calibration[name]), (cast, name)
        if before is not None:
            assert torch.equal(metric(*pair), before), cast
    assert {buffer.dtype for buffer in build().double().buffers()} == {torch.float64}


@bf16_anywhere
def test_statistics_of_a_bf16_extractor_are_pooled_in_float32() -> None:
    images = photos(32, 4)
    low = feature_statistics(tiny_extractor(precision="bf16"), images, layer="conv2", pool="avg", keep=4)
    full = feature_statistics(tiny_extractor(), images, layer="conv2", pool="avg", keep=4)
    assert low.mean.dtype == torch.float64 and low.count == 4
    assert low.origin is not None and full.origin is not None
    assert (low.origin.precision, full.origin.precision) == ("bf16", "float32")  # named when the two are compared
    torch.testing.assert_close(low.mean, full.mean, rtol=0.02, atol=0.02 * float(full.mean.abs().max()))
    feature = PooledFeatures(tiny_extractor(precision="bf16"), "conv2")
    assert feature(images).dtype == torch.float32


def test_fid_builders_forward_the_precision() -> None:
    torch.manual_seed(0)
    ext = fid_extractor(weights=None, device="cpu", precision="bf16")
    assert ext.precision == "bf16" and ext.memory_format == "contiguous"
    with pytest.raises(InvalidValueError, match="precision"):
        fid_statistics(torch.rand(2, 3, 32, 32), extractor=ext, precision="bf16")
