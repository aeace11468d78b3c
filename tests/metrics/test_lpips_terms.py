"""Per-layer LPIPS terms (issue 43): ``return_layers=True`` gives each layer's term as ``lpips.LPIPS(retPerLayer=True)``
does, to 1e-6 on the same trunk weights and heads for the three nets, reduced as the total is and summing to it."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from featurehooks.metrics.lpips import LPIPS

lpips = pytest.importorskip("lpips")

# the VGG16 trunk, the slowest of the three, only in make test (not in make test-fast), as in test_lpips.py
NETS = ["alex", pytest.param("vgg", marks=pytest.mark.slow), "squeeze"]


@pytest.fixture(scope="module")
def pair() -> tuple[torch.Tensor, torch.Tensor]:
    """Two batches in [0, 1], not square, just above AlexNet's smallest side (31)."""
    generator = torch.Generator().manual_seed(9)
    return torch.rand(2, 3, 40, 36, generator=generator), torch.rand(2, 3, 40, 36, generator=generator)


def reference(net: str, **kwargs: object) -> torch.nn.Module:
    with contextlib.redirect_stdout(io.StringIO()):  # lpips prints on construction
        return lpips.LPIPS(net=net, verbose=False, **kwargs)


@pytest.mark.parametrize("net", NETS)
def test_layer_terms_equal_lpips_ret_per_layer(lpips_trunks: None, pair, net: str) -> None:
    x, y = pair
    with torch.no_grad():
        expected_total, expected_terms = reference(net)(2 * x - 1, 2 * y - 1, retPerLayer=True)
        total, terms = LPIPS(net, reduction="none")(x, y, return_layers=True)
        mean_total, mean_terms = LPIPS(net)(x, y, return_layers=True)
        maps_total, maps = LPIPS(net, spatial=True, reduction="none")(x, y, return_layers=True)
        _, expected_maps = reference(net, spatial=True)(2 * x - 1, 2 * y - 1, retPerLayer=True)
    assert len(terms) == len(expected_terms) == len(maps) and list(terms) == list(maps)
    for (name, term), expected in zip(terms.items(), expected_terms):
        assert term.shape == (2,) and expected.shape == (2, 1, 1, 1)
        torch.testing.assert_close(term, expected.flatten(), atol=1e-6, rtol=0, msg=f"{net} {name}")
        torch.testing.assert_close(mean_terms[name], term.mean(), atol=1e-7, rtol=0)
    for (name, term_map), expected_map in zip(maps.items(), expected_maps):
        assert term_map.shape == expected_map.shape == (2, 1, 40, 36)
        torch.testing.assert_close(term_map, expected_map, atol=1e-6, rtol=0, msg=f"{net} {name}")
    torch.testing.assert_close(total, expected_total.flatten(), atol=1e-6, rtol=0)
    torch.testing.assert_close(sum(terms.values()), total, atol=1e-7, rtol=0)
    torch.testing.assert_close(sum(mean_terms.values()), mean_total, atol=1e-7, rtol=0)
    torch.testing.assert_close(sum(maps.values()), maps_total, atol=1e-7, rtol=0)


def test_the_default_return_is_the_total_alone(lpips_trunks: None, pair) -> None:
    """return_layers is opt-in: the default call returns one tensor, bitwise the total of a call with terms."""
    x, y = pair
    metric = LPIPS("squeeze", reduction="none")
    value = metric(x, y)
    total, _ = metric(x, y, return_layers=True)
    assert isinstance(value, torch.Tensor) and torch.equal(value, total)
