"""The pure functions under the losses: Gram matrices, channel normalization, distances, TV, reductions."""

from __future__ import annotations

import pytest
import torch

import featurehooks.functional as F


def _gram_loop(x: torch.Tensor) -> torch.Tensor:
    b, c = x.shape[:2]
    return torch.stack([x[i].reshape(c, -1) @ x[i].reshape(c, -1).T for i in range(b)])


@pytest.mark.parametrize(("normalization", "divisor"), [("none", 1), ("hw", 6 * 5), ("chw", 4 * 6 * 5)])
def test_gram_matrix_matches_a_per_sample_loop(normalization: str, divisor: int) -> None:
    x = torch.randn(3, 4, 6, 5, dtype=torch.float64)
    gram = F.gram_matrix(x, normalization)
    assert gram.shape == (3, 4, 4) and gram.dtype == torch.float64
    torch.testing.assert_close(gram, _gram_loop(x) / divisor)
    torch.testing.assert_close(gram, gram.transpose(1, 2))


def test_gram_matrix_default_is_chw_and_accepts_flat_positions() -> None:
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(F.gram_matrix(x), F.gram_matrix(x.flatten(2), "chw"))
    torch.testing.assert_close(F.gram_matrix(x), _gram_loop(x) / 48)


def test_gram_matrix_of_large_float16_activations_is_finite_in_float32() -> None:
    x = torch.full((1, 8, 64, 64), 300.0, dtype=torch.float16, requires_grad=True)
    naive = torch.bmm(x.detach().flatten(2), x.detach().flatten(2).transpose(1, 2))
    assert torch.isinf(naive).all()  # what float16 gives: 300**2 * 4096 overflows
    gram = F.gram_matrix(x, "none")
    assert gram.dtype == torch.float32
    torch.testing.assert_close(gram, torch.full((1, 8, 8), 300.0**2 * 4096))
    F.gram_matrix(x).sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float16 and torch.isfinite(x.grad).all()


def test_gram_matrix_runs_in_float32_under_autocast() -> None:
    x = torch.randn(2, 16, 8, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        features = torch.nn.functional.conv2d(x, torch.randn(16, 16, 3, 3), padding=1)
        assert features.dtype == torch.bfloat16
        gram = F.gram_matrix(features)
    assert gram.dtype == torch.float32
    torch.testing.assert_close(gram, _gram_loop(features.float()) / (16 * 64), rtol=1e-5, atol=1e-5)
    gram.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_gram_matrix_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="normalization"):
        F.gram_matrix(torch.rand(1, 2, 3, 3), "ch")
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        F.gram_matrix(torch.rand(2, 3))
    with pytest.raises(TypeError):
        F.gram_matrix([[1.0]])


def test_channel_normalize_gives_unit_vectors() -> None:
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    norms = F.channel_normalize(x).pow(2).sum(1).sqrt()
    torch.testing.assert_close(norms, torch.ones_like(norms))


def test_channel_normalize_has_finite_gradients_at_all_zero_vectors() -> None:
    x = torch.zeros(1, 4, 3, 3, requires_grad=True)
    y = torch.rand(1, 4, 3, 3)
    out = F.channel_normalize(x)
    assert (out == 0).all()
    (out - y).pow(2).sum().backward()
    assert torch.isfinite(x.grad).all()
    # eps outside the sqrt (as lpips and piq do it) gives NaN here
    z = torch.zeros(1, 4, 3, 3, requires_grad=True)
    (z / (z.pow(2).sum(1, keepdim=True).sqrt() + 1e-10) - y).pow(2).sum().backward()
    assert torch.isnan(z.grad).all()


def test_channel_normalize_under_autocast_returns_float32() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.channel_normalize(torch.randn(1, 4, 2, 2).bfloat16())
    assert out.dtype == torch.float32
    with pytest.raises(ValueError, match="eps"):
        F.channel_normalize(torch.rand(1, 2, 2, 2), eps=0)


def test_feature_distance_is_a_per_sample_mean() -> None:
    x, y = torch.randn(3, 4, 5, 5), torch.randn(3, 4, 5, 5)
    torch.testing.assert_close(F.feature_distance(x, y), ((x - y) ** 2).mean((1, 2, 3)))
    torch.testing.assert_close(F.feature_distance(x, y, "l1"), (x - y).abs().mean((1, 2, 3)))
    cosine = 1 - torch.nn.functional.cosine_similarity(x, y, dim=1)
    torch.testing.assert_close(F.feature_distance(x, y, "cosine"), cosine.mean((1, 2)))
    torch.testing.assert_close(F.feature_distance(x, y[:1]), ((x - y[:1]) ** 2).mean((1, 2, 3)))
    doubled = F.feature_distance(x, y, lambda a, b: (a - b).abs() * 2)
    torch.testing.assert_close(doubled, 2 * F.feature_distance(x, y, "l1"))
    assert (F.feature_distance(x, x, "smooth_l1") == 0).all()
    assert torch.allclose(F.feature_distance(x, x, "charbonnier"), torch.full((3,), 1e-3))
    with pytest.raises(ValueError, match="distance must be one of"):
        F.feature_distance(x, y, "l3")


def test_reduce_loss() -> None:
    values = torch.tensor([1.0, 2.0, 6.0])
    assert F.reduce_loss(values) == 3.0
    assert F.reduce_loss(values, "sum") == 9.0
    assert F.reduce_loss(values, "none") is values
    with pytest.raises(ValueError, match="reduction"):
        F.reduce_loss(values, "avg")


def test_total_variation_of_known_images() -> None:
    flat = torch.full((2, 3, 8, 8), 0.5)
    assert F.total_variation(flat) == 0
    stripes = torch.zeros(1, 1, 4, 4)
    stripes[..., 1::2] = 1.0  # vertical stripes: every horizontal step changes by 1, no vertical one
    assert F.total_variation(stripes) == pytest.approx(1.0)
    assert F.total_variation(2 * stripes, "l2") == pytest.approx(4.0)
    checker = (torch.arange(4).view(4, 1) + torch.arange(4).view(1, 4)).remainder(2).float().view(1, 1, 4, 4)
    assert F.total_variation(checker) == pytest.approx(2.0)
    batch = torch.cat([flat[:1, :1, :4, :4], stripes])
    torch.testing.assert_close(F.total_variation(batch, reduction="none"), torch.tensor([0.0, 1.0]))


def test_total_variation_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        F.total_variation(torch.rand(1, 3, 1, 8))
    with pytest.raises(ValueError, match="norm"):
        F.total_variation(torch.rand(1, 3, 4, 4), "l3")
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        F.total_variation(torch.rand(3, 4, 4))
