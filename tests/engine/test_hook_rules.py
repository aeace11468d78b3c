"""The rules every hook featurehooks puts on a user's model follows (issue 19 items 2, 4, 5).

- Probes serve containers: a model whose own ``forward`` never runs (a Lightning-style module that
  calls ``self.G`` and ``self.D``, an ``nn.ModuleDict``) is probed per top-level call of a submodule.
- Copies are inert and everything pickles: ``torch.save``/``pickle``/``copy.deepcopy`` of a model under
  a gradient modifier, a probe or ``capture`` work, and the copy is neither modified nor observed.
- A KeyboardInterrupt in mid-forward (which skips torch's ``always_call`` hooks) leaves nothing stale.
"""

from __future__ import annotations

import copy
import gc
import io
import math
import multiprocessing
import pickle
import weakref

import pytest
import torch
from torch import nn

import featurehooks as fh
from featurehooks.errors import NonFiniteError
from featurehooks.probes import detect_nonfinite, reverse_grad, scale_grad, watch


class Gan(nn.Module):
    """A Lightning-style container: the training step calls ``self.G`` and ``self.D``, never ``self``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.G = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6))
        self.D = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))

    def step(self, z: torch.Tensor) -> torch.Tensor:
        return self.D(self.G(z)).mean()


class Poison(nn.Module):
    """Makes a NaN when armed."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * math.nan if self.armed else x


class Interrupt(nn.Module):
    """Raises KeyboardInterrupt (a Ctrl-C) once when armed."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return x


def module_hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# Containers -------------------------------------------------------------------------------------


def test_watch_serves_a_container_whose_forward_never_runs() -> None:
    gan = Gan()
    with watch(gan) as w:
        for _ in range(3):
            gan.step(torch.randn(5, 4)).backward()
    rows = {(row.name, row.kind): row for row in w.summary()}
    assert set(rows) == {(f"{net}.{k}", kind) for net in "GD" for k in (0, 2) for kind in ("output", "grad")}
    assert all(row.calls == 3 for row in rows.values())
    with torch.no_grad():
        expected = gan.G[0](torch.ones(1, 4))
    with watch(gan, ["G.0"], grads=False) as w:
        gan.G(torch.ones(1, 4))
    assert w.summary()[0].mean == pytest.approx(expected.mean().item())


def test_watch_serves_a_module_dict() -> None:
    nets = nn.ModuleDict({"enc": nn.Linear(3, 4), "dec": nn.Linear(4, 3)})
    with watch(nets, grads=False) as w:
        nets["dec"](nets["enc"](torch.randn(2, 3)))
        nets["enc"](torch.randn(2, 3))
    calls = {row.name: row.calls for row in w.summary()}
    assert calls == {"enc": 2, "dec": 1}  # each top-level call is a forward of its own: call index 0


def test_nonfinite_fires_on_a_container_and_names_the_origin() -> None:
    gan = Gan()
    gan.G.insert(2, Poison())
    gan.step(torch.randn(2, 4))  # finite: no alarm
    with detect_nonfinite(gan):
        gan.step(torch.randn(2, 4)).backward()
        gan.G[2].armed = True
        with pytest.raises(NonFiniteError) as info:
            gan.step(torch.randn(2, 4))
    assert info.value.path == "G.2" and info.value.phase == "forward"


def test_nonfinite_fires_in_a_module_dict() -> None:
    nets = nn.ModuleDict({"enc": nn.Linear(3, 4), "bad": Poison()})
    nets["bad"].armed = True
    with pytest.raises(NonFiniteError) as info, detect_nonfinite(nets):
        nets["bad"](nets["enc"](torch.randn(2, 3)))
    assert info.value.path == "bad"


def test_a_module_calling_itself_is_one_forward() -> None:
    class Recurse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
            x = self.lin(x)
            return self(x, depth - 1) if depth else x

    holder = nn.ModuleDict({"r": Recurse()})
    with watch(holder, ["r.lin"], grads=False) as w:
        holder["r"](torch.randn(2, 3))
        holder["r"](torch.randn(2, 3))
    assert [(row.name, row.calls) for row in w.summary()] == [("r.lin", 2), ("r.lin_1", 2), ("r.lin_2", 2)]


# Copies and pickles -----------------------------------------------------------------------------


def _roundtrip(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)  # our own test object, not untrusted data


@pytest.mark.parametrize("target", ["module", "parameters"])
def test_a_model_under_a_gradient_modifier_pickles_and_its_copies_are_not_modified(target: str) -> None:
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    x = torch.ones(2, 3)
    plain = torch.autograd.grad(net(x).sum(), net[0].weight)[0]
    with reverse_grad(net[0] if target == "module" else net[0].parameters()):
        for twin in (_roundtrip(net), pickle.loads(pickle.dumps(net)), copy.deepcopy(net)):
            torch.testing.assert_close(torch.autograd.grad(twin(x).sum(), twin[0].weight)[0], plain)
        torch.testing.assert_close(torch.autograd.grad(net(x).sum(), net[0].weight)[0], -plain)


def test_stacked_modifiers_on_a_copy_are_all_inert() -> None:
    net = nn.Sequential(nn.Linear(3, 1))
    x = torch.ones(2, 3)
    plain = torch.autograd.grad(net(x).sum(), net[0].weight)[0]
    with scale_grad(net[0], 3.0), reverse_grad(net[0]):
        twin = copy.deepcopy(net)
        torch.testing.assert_close(torch.autograd.grad(twin(x).sum(), twin[0].weight)[0], plain)
    assert module_hooks(twin) == 2  # the inert copies remain, and do nothing


@pytest.mark.parametrize("grads", [False, True])
def test_a_captured_model_pickles_and_a_copy_run_inside_the_block_leaves_the_features(grads: bool) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(2, 3)
    with fh.capture(net, ["0", "2"], grads=grads) as feats:
        out = net(x)
        kept = {name: value.detach().clone() for name, value in feats.items()}
        ema = copy.deepcopy(net)  # an EMA or target network, run inside the block
        with torch.no_grad():
            for p in ema.parameters():
                p.mul_(0.5)
        ema(torch.randn(2, 3))
        _roundtrip(net)(x)
        pickle.loads(pickle.dumps(net))(x)
        assert list(feats) == ["0", "2"]
        for name, value in kept.items():
            torch.testing.assert_close(feats[name], value)
        if grads:
            out.sum().backward()
            assert feats.grads["2"].shape == (2, 2)
    ema(torch.randn(2, 3))  # after the block: no dead session is called


def test_a_copy_of_an_extractor_still_collects() -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3))
    extractor = fh.FeatureExtractor(net, layers=["1"], mode="detach")
    x = torch.rand(1, 3, 12, 12)
    for twin in (copy.deepcopy(extractor), pickle.loads(pickle.dumps(extractor))):
        torch.testing.assert_close(twin(x)["1"], extractor(x)["1"])


def test_nonfinite_error_pickles_with_its_fields() -> None:
    error = NonFiniteError("NaN in G.2", path="G.2", call=1, phase="backward", tensor="grad_input")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is NonFiniteError and str(again) == "NaN in G.2"
    assert (again.path, again.call, again.phase, again.tensor) == ("G.2", 1, "backward", "grad_input")


def _raise_nonfinite(k: int) -> int:
    raise NonFiniteError(f"NaN in call {k}", path="x", call=k, phase="forward", tensor="output")


def test_nonfinite_error_crosses_a_process_pool() -> None:
    with multiprocessing.get_context("fork").Pool(1) as pool:
        result = pool.map_async(_raise_nonfinite, [3])
        with pytest.raises(NonFiniteError) as info:
            result.get(timeout=30)  # before: the pool's result thread died unpickling it, and map hung
    assert info.value.call == 3


# KeyboardInterrupt ----------------------------------------------------------------------------------


def assert_forward_let_go(model: nn.Module) -> None:
    """A forward of ``model`` leaves nothing of itself on the session's stack: a forward kept there holds the frame
    of its opening call, and with it the input."""
    x = torch.randn(2, 3)
    seen = weakref.ref(x)
    model(x)
    del x
    gc.collect()
    assert seen() is None, "a finished forward is still held"


def _interrupted(model: nn.Module, stop: Interrupt, x: torch.Tensor) -> None:
    stop.armed = True
    with pytest.raises(KeyboardInterrupt):
        model(x)


def test_watch_after_a_keyboard_interrupt_counts_right() -> None:
    stop = Interrupt()
    model = nn.Sequential(nn.Linear(3, 3), stop, nn.Linear(3, 3))
    with watch(model, ["0", "2"], grads=False) as w:
        _interrupted(model, stop, torch.randn(2, 3))
        w.reset()
        model(torch.randn(2, 3))
        model[0](torch.randn(2, 3))  # on its own: a forward of its own, call 0
        assert_forward_let_go(model[0])
    assert [(row.name, row.calls) for row in w.summary()] == [("0", 3), ("2", 1)]


def test_nonfinite_after_a_keyboard_interrupt_still_fires_on_a_submodule_call() -> None:
    stop, poison = Interrupt(), Poison()
    model = nn.Sequential(nn.Linear(3, 3), stop, nn.Sequential(nn.Linear(3, 3), poison))
    with detect_nonfinite(model):
        _interrupted(model, stop, torch.randn(2, 3))
        poison.armed = True
        with pytest.raises(NonFiniteError) as info:
            model[2](torch.randn(2, 3))  # before: taken for a call inside the interrupted forward
        assert info.value.path == "2.1"
        poison.armed = False
        assert_forward_let_go(model)


def test_capture_after_a_keyboard_interrupt_releases_the_stale_forward() -> None:
    stop = Interrupt()
    model = nn.Sequential(nn.Identity(), nn.Linear(3, 3), stop, nn.Linear(3, 3))
    x = torch.randn(2, 3, requires_grad=True)
    with fh.capture(model, ["0", "3"], grads=True) as feats:
        model(torch.randn(2, 3))  # the first forward is traced on meta, where Interrupt would stop the trace
        _interrupted(model, stop, x)
        assert x._backward_hooks  # the slot of the interrupted forward's identity output (x itself)
        y = torch.randn(2, 3, requires_grad=True)
        model(y).sum().backward()
        assert not x._backward_hooks  # released when the next forward began
        torch.testing.assert_close(feats.grads["3"], torch.ones(2, 3))
    assert module_hooks(model) == 0
