"""watch's statistics against float64 on every path (exact, CPU fast path; ``test_watch_fused.py``: the compiled
one), every floating dtype, tiny and large calls, non-contiguous tensors, non-finite values, all zeros and extreme
magnitudes (float32 subnormals, squares past float32), for outputs and gradients."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator

import pytest
import torch
from probe_helpers import direct
from torch import Tensor, nn

from featurehooks.probes import _moments
from featurehooks.probes.watch import WatchRow, watch

watch_module = importlib.import_module("featurehooks.probes.watch")  # the package exports the function by that name

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]

# magnitudes each dtype holds (float16: 6e-8 to 65504), as (scale, path the CPU takes for its finite values)
MAGNITUDES = {
    "normal": (1.0, "fast"),
    "1e-23": (1e-23, "exact"),
    "1e-30": (1e-30, "exact"),
    "1e-40 (float32 subnormals)": (1e-40, "exact"),
    "1e30": (1e30, "exact"),
    "3e38": (3e38, "exact"),
    "1e-12": (1e-12, "fast"),  # just above the range's bottom, 2**-40
    "1e16": (1e16, "fast"),  # just below its top, 2**56
}
HALF_MAGNITUDES = {"normal": (1.0, "fast"), "1e-7 (subnormals)": (1e-7, "fast"), "6e4": (6e4, "fast")}


class Clone(nn.Module):
    """An output of its own whose gradient is the one passed to ``backward``."""

    def forward(self, x: Tensor) -> Tensor:
        return x.clone()


@pytest.fixture(params=["host", "device"])
def read_now(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways of summing: on the host, read at once (the CPU), and on the device with no sync (an accelerator's,
    taken on the CPU here)."""
    if request.param == "device":
        monkeypatch.setattr(watch_module, "READ_AT_ONCE", frozenset())
    return request.param == "host"


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths the calls took, in order: "fast" when the CPU fast path answered, else "exact"."""
    taken: list[str] = []
    fast, exact = _moments.fast_moments, _moments.exact_moments

    def spied_fast(*args: object, **kwargs: object) -> list[float] | None:
        answer = fast(*args, **kwargs)  # type: ignore[arg-type]
        if answer is not None:
            taken.append("fast")
        return answer

    def spied_exact(*args: object, **kwargs: object) -> Tensor:
        taken.append("exact")
        return exact(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_moments, "fast_moments", spied_fast)
    monkeypatch.setattr(_moments, "exact_moments", spied_exact)
    return taken


def reference(*tensors: Tensor) -> dict[str, float]:
    """The statistics of the values of ``tensors`` together, in float64."""
    return direct(torch.cat([t.detach().flatten() for t in tensors]))


def assert_matches(row: WatchRow, expected: dict[str, float]) -> None:
    """Counts, extremes and zeros exactly; the mean to 1e-6 of the absolute maximum, the std to 1e-5 of itself."""
    for stat in ("count", "nonfinite", "zeros"):
        assert getattr(row, stat) == expected.get(stat, getattr(row, stat)), stat
    for stat in ("min", "max", "absmax"):
        assert getattr(row, stat) == pytest.approx(expected[stat], rel=0, nan_ok=True), stat
    scale = expected["absmax"] if math.isfinite(expected["absmax"]) else 0.0
    assert row.mean == pytest.approx(expected["mean"], rel=1e-6, abs=1e-6 * scale, nan_ok=True)
    assert row.std == pytest.approx(expected["std"], rel=1e-5, abs=1e-12 * scale, nan_ok=True)


def rows(calls: list[Tensor], grads: list[Tensor] | None = None) -> Iterator[WatchRow]:
    """The output row (and with ``grads`` the gradient row) of a watched module called once per tensor of
    ``calls``, each call's output given the gradient of the same index."""
    model = nn.Sequential(Clone())
    with watch(model, ["0"], grads=grads is not None) as w:
        for k, x in enumerate(calls):
            out = model(x.requires_grad_(grads is not None))
            if grads is not None:
                out.backward(grads[k])
    yield from w.summary()


def seeded(n: int, dtype: torch.dtype, seed: int, scale: float = 1.0, offset: float = 0.0) -> Tensor:
    """``n`` values ``offset + scale * N(0, 1)``, drawn in float64 and rounded once to ``dtype``; uniform in
    [-scale, scale] where a normal draw could pass the dtype's largest value."""
    g = torch.Generator().manual_seed(seed)
    if scale * 6 > torch.finfo(dtype).max:
        values = (2 * torch.rand(n, generator=g, dtype=torch.float64) - 1) * scale
    else:
        values = offset + scale * torch.randn(n, generator=g, dtype=torch.float64)
    return values.to(dtype)


def magnitudes(dtype: torch.dtype) -> dict[str, tuple[float, str]]:
    return HALF_MAGNITUDES if dtype == torch.float16 else MAGNITUDES


CASES = [(dtype, name) for dtype in DTYPES for name in magnitudes(dtype)]


@pytest.mark.parametrize(("dtype", "magnitude"), CASES, ids=[f"{d}-{m}" for d, m in CASES])
def test_outputs_and_gradients_at_every_magnitude(
    dtype: torch.dtype, magnitude: str, read_now: bool, paths: list[str]
) -> None:
    """Issue 39: float32 squares of values near 1e-23 lost 65-97% of the std, all of it from 1e-30."""
    scale, path = magnitudes(dtype)[magnitude]
    calls = [seeded(3 * 1024 + 5, dtype, seed=1, scale=scale), seeded(700, dtype, seed=2, scale=scale)]
    grads = [seeded(3 * 1024 + 5, dtype, seed=3, scale=scale), seeded(700, dtype, seed=4, scale=scale)]
    output, grad = rows(calls, grads)
    assert (output.kind, grad.kind) == ("output", "grad")
    assert_matches(output, reference(*calls))
    assert_matches(grad, reference(*grads))
    assert output.std > 0 and grad.std > 0
    fast = read_now and dtype != torch.float64 and path == "fast"
    assert set(paths) == {"fast" if fast else "exact"}


SIZES = [1, 5, 1023, 1024, 2 * 1024 + 7, (1 << 14) + 1, 70_001, (1 << 19) + 3]


def layouts(x: Tensor) -> list[Tensor]:
    """``x`` dense and in other layouts: a transposed view, a strided slice, channels-last, a broadcast."""
    n = x.numel()
    if n < 24:
        return [x, x.view(1, -1).t(), x.expand(3, n)[:, ::2]]
    even = x[: n - n % 2]
    return [x, even.view(2, -1).t(), x[::2], x[: n // 24 * 24].view(-1, 3, 2, 4).to(memory_format=torch.channels_last)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_tiny_and_large_calls_dense_or_not(size: int, dtype: torch.dtype, read_now: bool) -> None:
    """Sizes below and above a row of 1024, the compiled kernel's 2048 and the former float64-at-once and chunk
    sizes; each layout a call of its own, then all of them in one row."""
    x = seeded(size, dtype, seed=size).relu()  # zeros too
    calls = layouts(x)
    for call in calls:
        (row,) = rows([call])
        assert_matches(row, reference(call))
    (row,) = rows(calls)
    assert row.calls == len(calls)
    assert_matches(row, reference(*calls))


def odd_values(dtype: torch.dtype) -> dict[str, Callable[[], Tensor]]:
    big = 3e38 if dtype != torch.float16 else 6e4
    return {
        "all zeros": lambda: torch.zeros(5000, dtype=dtype),
        "zeros and -0.0": lambda: torch.tensor([0.0, -0.0] * 1500, dtype=dtype),
        "NaN and inf among values": lambda: torch.cat(
            [seeded(4100, dtype, seed=5), torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)]
        ),
        "NaN among extreme values": lambda: torch.cat(
            [seeded(2000, dtype, seed=6, scale=big), torch.tensor([math.nan], dtype=dtype)]
        ),
        "nothing finite": lambda: torch.tensor([math.nan, math.inf, -math.inf] * 700, dtype=dtype),
        "one value": lambda: torch.tensor([-2.5], dtype=dtype),
        "a constant": lambda: torch.full((3000,), 7.25, dtype=dtype),
        "mean far above the spread": lambda: seeded(40_000, dtype, seed=7, scale=0.5, offset=3000.0),
    }


ODD = [(dtype, name) for dtype in DTYPES for name in odd_values(dtype)]


@pytest.mark.parametrize(("dtype", "case"), ODD, ids=[f"{d}-{c}" for d, c in ODD])
def test_odd_values(dtype: torch.dtype, case: str, read_now: bool) -> None:
    x = odd_values(dtype)[case]()
    (row,) = rows([x, x.flip(0)])
    assert_matches(row, reference(x, x))
    if case == "nothing finite":
        assert row.nonfinite == row.count and math.isnan(row.mean) and math.isnan(row.std)


def test_the_fast_path_declines_what_its_float32_squares_cannot_hold() -> None:
    """The CPU fast path answers for finite values between 2**-40 and 2**56 in absolute maximum (and all zeros), and
    leaves the rest to the exact path."""
    need = _moments.Need.of(frozenset({"std", "min", "zeros"}))
    scratch = _moments.Scratch()

    def answers(x: Tensor) -> bool:
        return _moments.fast_moments(x, need, scratch, 0.0, fused=False) is not None

    ones = torch.ones(3000)
    assert answers(ones) and answers(ones * 2.0**-40) and answers(ones * 2.0**56) and answers(torch.zeros(3000))
    assert not answers(ones * 2.0**-41) and not answers(ones * 2.0**57)
    assert not answers(torch.tensor([1.0, math.nan])) and not answers(torch.tensor([1.0, math.inf]))
