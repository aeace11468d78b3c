"""intermediates: early exit on a live module, against CUT's own ``encode_only`` forward and hand-written forwards."""

from __future__ import annotations

import copy
import gc
import threading
import weakref
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from featurehooks import _intermediates, intermediates
from featurehooks.errors import InvalidTypeError, InvalidValueError, LayerNotFoundError

from helpers import load_script

cut = load_script("benchmarks/live_exit.py")  # CUT's ResnetGenerator, its nce_layers and a loss on features
PATHS = cut.nce_paths()


def generators(norm: str = "instance", *, train: bool = True) -> tuple[nn.Module, nn.Module]:
    """Two equal CUT generators (ngf 8, 5 blocks: layer 16 is the last block): CUT's own forward runs the first."""
    torch.manual_seed(0)
    theirs = cut.ResnetGenerator(ngf=8, n_blocks=5, norm=norm).train(train)
    return theirs, copy.deepcopy(theirs)


def images(seed: int = 0, size: int = 64) -> Tensor:
    return torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def backward(model: nn.Module, feats: list[Tensor]) -> None:
    model.zero_grad(set_to_none=True)
    cut.feature_loss(feats).backward()


def assert_same_module(theirs: nn.Module, ours: nn.Module) -> None:
    """Parameters, buffers, gradients, train/eval and requires_grad flags bitwise the same."""
    a, b = theirs.state_dict(), ours.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    for (name, p), q in zip(theirs.named_parameters(), ours.parameters()):
        assert p.requires_grad == q.requires_grad and (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name
    assert [m.training for m in theirs.modules()] == [m.training for m in ours.modules()]


@pytest.mark.parametrize(
    ("norm", "train"), [("instance", True), ("batch", True), ("batch", False)], ids=["instance", "batch", "batch-eval"]
)  # CUT's default instance norm has no statistics: it runs the same in eval
def test_cut_patchnce_features_grads_and_state_bitwise(norm: str, train: bool) -> None:
    theirs, ours = generators(norm, train=train)
    for step in range(2):  # the second step reuses the plan of the first
        x = images(step)
        expected = theirs(x, cut.NCE_LAYERS, encode_only=True)
        got = intermediates(ours, x, PATHS)
        assert list(got) == PATHS
        assert all(torch.equal(e, g) for e, g in zip(expected, got.values()))
        assert [g.requires_grad for g in got.values()] == [False, True, True, True, True]  # model.0 pads the image
        backward(theirs, expected)
        backward(ours, list(got.values()))
        assert_same_module(theirs, ours)
    assert ours.model[1].weight.grad is not None and ours.model[-2].weight.grad is None  # nothing after model.16 ran
    if norm == "batch":  # the first norm after model.16 never saw a batch; the ones before did, in train mode only
        assert int(ours.model[19].num_batches_tracked) == 0
        assert int(ours.model[2].num_batches_tracked) == (2 if train else 0)  # two steps


class Noisy(nn.Module):
    """Noise drawn on the CPU whatever the device (a meta trace draws it too), then dropout (in train mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.drop, self.head = nn.Conv2d(3, 4, 1), nn.Dropout(0.5), nn.Conv2d(4, 4, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.drop(self.conv(x) + torch.randn(x.shape[0], 1, 1, 1).to(x.device))
        return self.head(h)


def test_random_state_is_the_forwards_own() -> None:
    # the first call's meta trace runs the forward too: the draws must be left to the real one
    net, x = Noisy().train(), torch.rand(2, 3, 4, 4)
    reference = copy.deepcopy(net)
    torch.manual_seed(1)
    expected = reference.drop(reference.conv(x) + torch.randn(2, 1, 1, 1))
    after = torch.random.get_rng_state()
    torch.manual_seed(1)
    got = intermediates(net, x, ["drop"])
    assert torch.equal(got["drop"], expected) and torch.equal(torch.random.get_rng_state(), after)


def test_one_plan_per_module_request_mode_and_input_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    traces: list[tuple[int, ...]] = []
    real = _intermediates.trace

    def counted(model: nn.Module, args: tuple[Any, ...], *rest: Any, **options: Any) -> Any:
        traces.append(tuple(args[0].shape))
        return real(model, args, *rest, **options)

    monkeypatch.setattr(_intermediates, "trace", counted)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
    x = torch.rand(1, 3, 12, 12)
    for _ in range(3):
        intermediates(net, x, ["0", "2"])
    assert len(traces) == 1
    intermediates(net, torch.rand(2, 3, 12, 12), ["0", "2"])  # another shape
    intermediates(net.eval(), x, ["0", "2"])  # another mode
    intermediates(net, x, {"0": "conv"})  # another request
    intermediates(copy.deepcopy(net), x, {"0": "conv"})  # another module
    assert traces == [(1, 3, 12, 12), (2, 3, 12, 12), (1, 3, 12, 12), (1, 3, 12, 12), (1, 3, 12, 12)]


def test_a_submodule_replaced_or_made_in_place_is_planned_again() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
    x = torch.randn(1, 3, 8, 8)
    expected = net[0](x)
    assert (expected < 0).any()
    intermediates(net, x, ["0", "1"])  # planned: the ReLU leaves the convolution's output alone
    net[1].inplace = True  # now it overwrites it: the output must be copied before
    assert torch.equal(intermediates(net, x, ["0", "1"])["0"], expected)
    net[1] = nn.ReLU()
    intermediates(net, x, ["0", "1"])
    net[1] = nn.ReLU(inplace=True)  # another module
    assert torch.equal(intermediates(net, x, ["0", "1"])["0"], expected)


def test_a_remembered_plan_never_keeps_its_module_alive() -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    intermediates(net, torch.rand(1, 3, 8, 8), ["1"])
    alive = weakref.ref(net)
    del net
    gc.collect()
    assert alive() is None


class Counted(nn.Module):
    """A 1x1 convolution that counts its real calls (a meta trace runs on a copy: never counted here)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return self.conv(x)


def test_stops_after_the_deepest_layer_and_leaves_no_hook() -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 1), Counted(), nn.ReLU(), Counted())
    seen: list[str] = []
    net[1].register_forward_hook(lambda *_: seen.append("user hook"))  # the user's own hook: once per real call
    intermediates(net, torch.rand(1, 3, 4, 4), ["1", "0"])
    assert (net[1].calls, net[3].calls, seen) == (1, 0, ["user hook"])
    left = {path: len(m._forward_hooks) + len(m._forward_pre_hooks) for path, m in net.named_modules()}
    assert left == {"": 0, "0": 0, "1": 1, "1.conv": 0, "2": 0, "3": 0, "3.conv": 0}


def test_hooks_removed_after_an_error_in_the_forward() -> None:
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.head = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 1)

        def forward(self, x: Tensor, fail: bool = False) -> Tensor:
            x = self.conv(x)
            if fail:
                raise RuntimeError("the model's own error")
            return self.head(x)

    net = Fails()
    with pytest.raises(RuntimeError, match="the model's own error"):
        intermediates(net, torch.rand(1, 3, 4, 4), ["head"], fail=True)
    assert all(not m._forward_hooks for m in net.modules())


class Scaled(nn.Module):
    """Positional and keyword arguments past the first, one of them named like an argument of intermediates."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2, self.head = nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 1, 1)

    def forward(self, x: Tensor, bias: float, *, scale: float = 1.0, layers: int = 1) -> Tensor:
        h = self.conv1(x) * scale + bias
        for _ in range(layers):
            h = self.conv2(h)
        return self.head(h)


def test_positional_and_keyword_arguments_reach_the_forward() -> None:
    net, x = Scaled(), torch.rand(1, 3, 5, 5)
    got = intermediates(net, x, {"conv2_1": "second", "conv1": "first"}, 0.5, scale=2.0, layers=2)
    first = net.conv1(x)
    assert list(got) == ["second", "first"]
    assert torch.equal(got["first"], first)
    assert torch.equal(got["second"], net.conv2(net.conv2(first * 2.0 + 0.5)))
    once = intermediates(net, x, ["conv2"], 0.5, layers=2)  # the first of two calls: the forward stops there
    assert torch.equal(once["conv2"], net.conv2(first + 0.5))
    with pytest.raises(LayerNotFoundError, match=r"runs 1 time\(s\) per forward, named conv2"):
        intermediates(net, x, ["conv2_1"], 0.5, layers=1)  # the keyword reaches the meta trace too
    with pytest.raises(LayerNotFoundError, match="never runs in a forward"):
        intermediates(net, x, ["conv2"], 0.5, layers=0)


def test_output_changed_in_place_later_is_taken_before_the_change() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3))
    reference = copy.deepcopy(net)
    reference[1] = nn.ReLU()
    x = torch.randn(1, 3, 8, 8)
    got = intermediates(net, x, ["0", "2"])
    conv = reference[0](x)
    assert torch.equal(got["0"], conv) and bool((got["0"] < 0).any())  # pre-activation, as the conv returned it
    assert net[1].inplace is True  # the user's module is never switched out of place
    backward(net, list(got.values()))
    cut.feature_loss([conv, reference[2](reference[1](conv))]).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(net.parameters(), reference.parameters()))


def test_untraceable_model_clones_every_tap() -> None:
    class DataDependent(nn.Module):  # .item() in the forward: no meta trace
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.relu, self.head = nn.Conv2d(3, 4, 1), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 1)

        def forward(self, x: Tensor) -> Tensor:
            h = self.relu(self.conv(x)) if x.sum().item() > -1e9 else x
            return self.head(h)

    net, x = DataDependent(), torch.randn(1, 3, 4, 4)
    got = intermediates(net, x, ["conv", "head"])
    assert torch.equal(got["conv"], net.conv(x)) and bool((got["conv"] < 0).any())


def test_threads_each_get_their_own_outputs() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 1)).eval()
    inputs = [torch.rand(1, 3, 10, 10) for _ in range(4)]
    with torch.no_grad():
        serial = [intermediates(net, x, ["1", "2"]) for x in inputs]
    results: dict[int, list[dict[str, Tensor]]] = {}

    def work(i: int) -> None:
        with torch.no_grad():
            results[i] = [intermediates(net, inputs[i], ["1", "2"]) for _ in range(20)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, runs in results.items():
        assert all(torch.equal(run[k], serial[i][k]) for run in runs for k in ("1", "2"))
    assert len(results) == 4 and all(not m._forward_hooks for m in net.modules())


def test_errors_name_what_is_wrong() -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU())
    x = torch.rand(1, 3, 4, 4)
    with pytest.raises(LayerNotFoundError, match=r"unknown layer '2' for Sequential; did you mean '1' or '0'"):
        intermediates(net, x, ["2"])
    with pytest.raises(LayerNotFoundError, match=r"layer '0_1': module '0' of Sequential runs 1 time"):
        intermediates(net, x, ["0_1"])
    with pytest.raises(InvalidValueError, match="no layers requested"):
        intermediates(net, x, [])
    with pytest.raises(InvalidTypeError, match="intermediates takes an nn.Module, not function"):
        intermediates(lambda t: t, x, ["0"])  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="intermediates: the module is a TorchScript module"):
        intermediates(torch.jit.script(net), x, ["0"])
    inner = nn.Sequential(torch.jit.script(nn.Sequential(nn.Conv2d(3, 4, 1))), nn.ReLU())
    with pytest.raises(InvalidTypeError, match="'0' is a TorchScript module"):
        intermediates(inner, x, ["0.0"])
