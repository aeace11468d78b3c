"""Large CPU max pools of an extractor's private backbone run ATen's channels-last kernel on a copy of their input:
the bytes of every output stay those of the NCHW model (NaNs and signed zeros included), only sooner; small pools,
graphs, bfloat16 and a user's own live module keep the NCHW kernel."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import featurehooks as fh
from featurehooks._stream.independence import rows_independent
from featurehooks._tap_session import POOL_MIN_CHANNELS, POOL_MIN_ELEMENTS, pool_channels_last


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1), nn.Conv2d(16, 16, 3), nn.ReLU(),
        nn.MaxPool2d(2, ceil_mode=True), nn.Flatten(), nn.Linear(16 * 31 * 31, 4),
    ).eval()  # fmt: skip


@pytest.fixture
def pooled_layouts(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each ``F.max_pool2d`` call took a channels-last (and not NCHW) input."""
    seen: list[bool] = []
    plain = F.max_pool2d

    def recording(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
        return plain(x, *args, **kwargs)

    monkeypatch.setattr(F, "max_pool2d", recording)
    return seen


def test_large_pools_run_channels_last_and_every_output_keeps_the_nchw_bytes(pooled_layouts: list[bool]) -> None:
    model = net()
    ext = fh.FeatureExtractor(model, ["1", "2", "5", "7"], normalize=False, memory_format="contiguous")
    pooled_layouts.clear()  # the construction's trace, on meta tensors
    images = torch.rand(3, 3, 128, 128)  # pools of 3x16x128x128 and 3x16x62x62 values
    found = ext(images)
    assert pooled_layouts == [True, True]
    plain, x = {}, images
    with torch.no_grad():
        for i, layer in enumerate(model):  # the NCHW model itself, layer by layer
            x = plain[str(i)] = layer(x).clone()
    assert pooled_layouts[2:] == [False, False]
    for name, value in found.items():
        assert value.is_contiguous(), name  # NCHW again, as the model's next layer and the taps expect
        assert value.numpy().tobytes() == plain[name].numpy().tobytes(), name
    assert rows_independent(ext.backbone)  # the pipeline still cuts batches into micro-batches
    buffer = io.BytesIO()
    torch.save(ext, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(ext), torch.load(buffer, weights_only=False)):  # a copy's pools are its own
        assert twin.backbone[2].forward.pool is twin.backbone[2]
        assert twin(images)["7"].numpy().tobytes() == found["7"].numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_nans_signed_zeros_and_ties_come_out_as_the_nchw_kernel_gives_them(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    images = torch.randn(2, 16, 67, 61)
    for value, share in ((0.0, 0.3), (-0.0, 0.3), (float("nan"), 0.03), (float("-inf"), 0.03)):
        images[torch.rand(images.shape) < share] = value
    images = images.to(dtype)
    assert pool_channels_last(images)
    for pool in (nn.MaxPool2d(3, 2, 1), nn.MaxPool2d(2, ceil_mode=True), nn.MaxPool2d(3, 1, dilation=2)):
        ext = fh.FeatureExtractor(nn.Sequential(pool), ["0"], normalize=False).to(dtype)
        with ext.assume_in_range():  # NaNs and infinities on purpose
            found = ext(images)["0"]
        assert found.numpy().tobytes() == pool(images).numpy().tobytes()


def test_small_pools_graphs_bfloat16_and_a_users_live_module_keep_the_nchw_kernel(
    pooled_layouts: list[bool],
) -> None:
    images = torch.rand(2, 3, 128, 128)
    large = torch.rand(1, POOL_MIN_CHANNELS, 128, 128)
    assert large.numel() >= POOL_MIN_ELEMENTS and pool_channels_last(large)
    assert not pool_channels_last(large[:, :, :8])  # too few values: the copies would cost more
    assert not pool_channels_last(torch.rand(4, POOL_MIN_CHANNELS - 1, 128, 128))  # too few channels
    assert not pool_channels_last(large.bfloat16())  # its NaNs would come back with another bit pattern
    assert not pool_channels_last(large.contiguous(memory_format=torch.channels_last))
    assert not pool_channels_last(large.requires_grad_())  # a tie could route the gradient elsewhere
    ext = fh.FeatureExtractor(net(), ["2"], normalize=False, mode="grad", memory_format="contiguous")
    pooled_layouts.clear()  # the construction's trace, on meta tensors
    ext(images.requires_grad_()).get("2").sum().backward()
    assert pooled_layouts == [False]
    live = net()
    with fh.capture(live, ["2"]) as taps:  # the user's own module: never changed for speed
        live(images.detach())
    assert not any(pooled_layouts) and taps["2"].is_contiguous()
    assert all("forward" not in module.__dict__ for module in live.modules())
