"""``LossGroup(...)(input, target, mask=)`` (issue 43): every member inside the mask, the sum equal to the members
called with the mask by hand (values bitwise, input gradients to float rounding, under both normalizations); an
all-ones mask gives the unmasked group bitwise; a member that takes no mask (total variation) and a mask that is not
the input's size are refused before any forward."""

from __future__ import annotations

import pytest
import torch

import featurehooks.losses as fl
from featurehooks import FeatureExtractor
from featurehooks.errors import InvalidValueError
from featurehooks.metrics import LPIPS

from helpers import tiny_extractor

WEIGHTS = {"content": 2.0, "style": 10.0, "lpips": 0.5}


@pytest.fixture(scope="module")
def ext() -> FeatureExtractor:
    return tiny_extractor(("relu1", "conv2"), mode="grad")


@pytest.fixture(scope="module")
def lpips() -> LPIPS:
    torch.manual_seed(3)
    return LPIPS("alex", weights=None, reduction="none")


@pytest.fixture(scope="module")
def images() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input, target and two different holes (32x32: grids of 15x15 and 13x13, cells straddle the holes' edges)."""
    generator = torch.Generator().manual_seed(5)
    x, y = torch.rand(2, 3, 32, 32, generator=generator), torch.rand(2, 3, 32, 32, generator=generator)
    mask = torch.zeros(2, 1, 32, 32)
    mask[0, :, 4:20, 6:30] = 1
    mask[1, :, 10:, :12] = 1
    return x, y, mask


def members(ext: FeatureExtractor, lpips: LPIPS, normalization: str) -> dict[str, torch.nn.Module]:
    """A content and a style loss sharing ``ext``'s forwards, and LPIPS with a backbone of its own."""
    lpips.mask_normalization = normalization
    return {
        "content": fl.PerceptualLoss(ext, ["relu1", "conv2"], reduction="none", mask_normalization=normalization),
        "style": fl.StyleLoss(ext, ["conv2"], reduction="none", mask_normalization=normalization),
        "lpips": lpips,
    }


@pytest.mark.parametrize("normalization", ["mask", "image"])
def test_masked_group_equals_its_members_called_with_the_mask(
    ext: FeatureExtractor, lpips: LPIPS, images: tuple[torch.Tensor, ...], normalization: str
) -> None:
    x, y, mask = images
    losses = members(ext, lpips, normalization)
    group = fl.LossGroup(losses, weights=WEIGHTS)
    x_group, x_hand = x.clone().requires_grad_(), x.clone().requires_grad_()
    value = group(x_group, y, mask=mask)
    terms = [WEIGHTS[name] * loss(x_hand, y, mask=mask) for name, loss in losses.items()]
    by_hand = terms[0] + terms[1] + terms[2]
    assert torch.equal(value, by_hand)  # the same arithmetic: a shared forward computes the same features
    assert not torch.equal(value, group(x, y))  # the mask changes the number
    value.sum().backward()
    by_hand.sum().backward()
    torch.testing.assert_close(x_group.grad, x_hand.grad, rtol=1e-5, atol=1e-7)  # shared graph: summation order


def test_all_ones_mask_gives_the_unmasked_group_bitwise(
    ext: FeatureExtractor, lpips: LPIPS, images: tuple[torch.Tensor, ...]
) -> None:
    x, y, _ = images
    group = fl.LossGroup(members(ext, lpips, "mask"), weights=WEIGHTS)
    assert torch.equal(group(x, y, mask=torch.ones(1, 1, 32, 32)), group(x, y))
    assert torch.equal(group(x, y, mask=torch.ones(2, 1, 32, 32, dtype=torch.bool)), group(x, y))


def test_a_fixed_target_takes_the_mask_too(ext: FeatureExtractor, images: tuple[torch.Tensor, ...]) -> None:
    x, y, mask = images
    content = fl.PerceptualLoss(ext, ["conv2"], reduction="none")
    content.set_target(y)
    group = fl.LossGroup({"content": content})
    assert torch.equal(group(x, mask=mask), content(x, mask=mask))


def test_all_zeros_mask_gives_zero_with_a_warning(
    ext: FeatureExtractor, lpips: LPIPS, images: tuple[torch.Tensor, ...]
) -> None:
    x, y, _ = images
    group = fl.LossGroup(members(ext, lpips, "mask"))
    with pytest.warns(UserWarning, match="all zeros"):
        value = group(x, y, mask=torch.zeros(1, 1, 32, 32))
    assert torch.equal(value, torch.zeros(2))


def test_a_member_without_mask_and_a_mask_of_another_size_are_refused(
    ext: FeatureExtractor, images: tuple[torch.Tensor, ...]
) -> None:
    x, y, mask = images
    group = fl.LossGroup({"content": fl.PerceptualLoss(ext, ["conv2"]), "tv": fl.TotalVariationLoss()})
    assert group(x, y).shape == ()  # unmasked, the prior is welcome
    with pytest.raises(InvalidValueError, match=r"loss 'tv' \(TotalVariationLoss\) of this group takes no mask="):
        group(x, y, mask=mask)
    alone = fl.LossGroup({"content": fl.PerceptualLoss(ext, ["conv2"])})
    with pytest.raises(InvalidValueError, match=r"mask must have shape \(2 or 1, 1, 32, 32\) \(the images' size\)"):
        alone(x, y, mask=mask[..., :16, :16])
