"""Gradient modifiers: each changes .grad exactly as the same change written into the forward by hand."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import featurehooks as fh
from featurehooks.probes.modifiers import GradModifier, clip_grad, reverse_grad, scale_grad

Change = Callable[[torch.Tensor], torch.Tensor]


def make_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(inplace=True),  # changes the conv's output in place after the modifier's hook
        nn.Conv2d(4, 4, 3),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
    )


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(2, 3, 8, 8, generator=generator), torch.randn(2, 3, generator=generator)


def loss_of(net: nn.Module, changed: int | None = None, change: Change | None = None) -> torch.Tensor:
    """The loss of ``net``, run layer by layer; ``change`` is applied to the output of layer ``changed``."""
    x, target = inputs()
    for index, layer in enumerate(net):
        x = layer(x)
        if index == changed and change is not None:
            x = change(x)
    return ((x - target) ** 2).sum()


def grads(net: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in net.parameters()]


def scaled_by_hand(factor: float) -> Change:
    """The value unchanged (exactly: ``y - y.detach()`` is 0), the gradient multiplied by ``factor``."""
    return lambda y: y.detach() + factor * (y - y.detach())


class _ClipBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, y: torch.Tensor, value: float) -> torch.Tensor:  # type: ignore[override]
        ctx.value = value  # type: ignore[attr-defined]
        return y.clone()  # a view returned by a custom Function may not be changed in place

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad.clamp(-ctx.value, ctx.value), None  # type: ignore[attr-defined]


def clipped_by_hand(value: float) -> Change:
    return lambda y: _ClipBackward.apply(y, value)


def assert_same(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("layer", [0, 2], ids=["conv-then-inplace-relu", "conv"])
@pytest.mark.parametrize(
    ("modifier", "by_hand"),
    [
        (lambda m: scale_grad(m, 0.3), scaled_by_hand(0.3)),
        (lambda m: scale_grad(m, -2.0), scaled_by_hand(-2.0)),
        (lambda m: reverse_grad(m), scaled_by_hand(-1.0)),
        (lambda m: reverse_grad(m, factor=0.7), scaled_by_hand(-0.7)),
    ],
    ids=["scale", "scale-negative", "reverse", "reverse-0.7"],
)
def test_module_modifiers_equal_the_change_written_into_the_forward(
    layer: int, modifier: Callable[[nn.Module], GradModifier], by_hand: Change
) -> None:
    net, reference = make_net(), make_net()
    with modifier(net[layer]):
        loss_of(net).backward()
    loss_of(reference, layer, by_hand).backward()
    assert_same(grads(net), grads(reference))
    plain = make_net()
    loss_of(plain).backward()
    assert not torch.equal(grads(net)[0], grads(plain)[0])
    assert torch.equal(grads(net)[-1], grads(plain)[-1]), "layers after the module keep their gradients"


@pytest.mark.parametrize("layer", [0, 2], ids=["conv-then-inplace-relu", "conv"])
def test_clip_grad_equals_a_clamp_in_backward_and_the_analytic_gradient(layer: int) -> None:
    # Pick a bound that the gradient at the module's output crosses.
    probe = make_net()
    x, target = inputs()
    returned = probe[: layer + 1](x)  # the module's output; a copy goes on, as an in-place ReLU may follow
    (grad_out,) = torch.autograd.grad(((probe[layer + 1 :](returned.clone()) - target) ** 2).sum(), [returned])
    value = float(grad_out.abs().max()) / 3
    clipped = grad_out.clamp(-value, value)
    assert not torch.equal(clipped, grad_out)

    net, reference = make_net(), make_net()
    with clip_grad(net[layer], value):
        loss_of(net).backward()
    loss_of(reference, layer, clipped_by_hand(value)).backward()
    assert_same(grads(net), grads(reference))
    # Analytic: the parameters up to the module get the vector-Jacobian product of the clipped gradient.
    before = [p for module in probe[: layer + 1] for p in module.parameters()]
    expected = torch.autograd.grad(returned, before, grad_outputs=clipped)
    for got, want in zip(grads(net), expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_parameter_scaling_gives_exactly_factor_times_grad_also_accumulated() -> None:
    net, plain = make_net(), make_net()
    with scale_grad(net.parameters(), 0.1):
        loss_of(net).backward()
        loss_of(net).backward()  # .grad accumulates factor * grad, not factor * (all of .grad)
    loss_of(plain).backward()
    single = grads(plain)
    assert_same(grads(net), [g * 0.1 + g * 0.1 for g in single])
    one = make_net()
    with scale_grad(one[0].weight, 4.0), clip_grad([one[0].bias], 1e-3):
        loss_of(one).backward()
    assert torch.equal(one[0].weight.grad, single[0] * 4.0)
    assert torch.equal(one[0].bias.grad, single[1].clamp(-1e-3, 1e-3))
    assert torch.equal(one[2].weight.grad, single[2])


def test_two_modifiers_compose_in_the_order_they_were_put_on() -> None:
    net, once = make_net(), make_net()
    with scale_grad(net[2], 2.0), scale_grad(net[2], 3.0):
        loss_of(net).backward()
    with scale_grad(once[2], 6.0):
        loss_of(once).backward()
    assert_same(grads(net), grads(once))

    value = 0.05
    for first_clip in (True, False):
        net, reference = make_net(), make_net()
        first = clip_grad(net[2], value) if first_clip else scale_grad(net[2], 10.0)
        second = scale_grad(net[2], 10.0) if first_clip else clip_grad(net[2], value)
        with first, second:
            loss_of(net).backward()
        # Modifiers stack like layers written after the module, in the order they were put on.
        by_hand: Change = (
            (lambda y: scaled_by_hand(10.0)(clipped_by_hand(value)(y)))
            if first_clip
            else (lambda y: clipped_by_hand(value)(scaled_by_hand(10.0)(y)))
        )
        loss_of(reference, 2, by_hand).backward()
        assert_same(grads(net), grads(reference))


def forward_loss(net: nn.Module) -> torch.Tensor:
    x, target = inputs()
    return ((net(x) - target) ** 2).sum()


def test_capture_reads_the_gradient_where_its_hook_sits_relative_to_the_modifier() -> None:
    net = make_net()
    with fh.capture(net, ["2"], grads=True) as before, scale_grad(net[2], 3.0):
        forward_loss(net).backward()  # captured before the modifier: the gradient that enters the module
    net = make_net()
    with scale_grad(net[2], 3.0), fh.capture(net, ["2"], grads=True) as after:
        forward_loss(net).backward()  # captured after it: the gradient as it arrives from downstream
    assert torch.equal(before.grads["2"], after.grads["2"] * 3.0)
    torch.testing.assert_close(before["2"], after["2"])


def hook_count(net: nn.Module) -> int:
    modules = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules())
    return modules + sum(len(p._backward_hooks or {}) for p in net.parameters())


def test_handles_are_gone_after_remove_the_block_and_an_exception() -> None:
    net, plain = make_net(), make_net()
    loss_of(plain).backward()
    handle = reverse_grad(net[2])
    params = scale_grad(net.parameters(), 2.0)
    assert hook_count(net) == 1 + 6 and handle.active
    handle.remove()
    params.remove()
    params.remove()  # twice is fine
    assert hook_count(net) == 0 and not handle.active and "removed" in repr(handle)
    with pytest.raises(RuntimeError, match="boom"), scale_grad(net[0], 5.0), clip_grad(net.parameters(), 1e-9):
        loss_of(net)
        raise RuntimeError("boom")
    assert hook_count(net) == 0
    net.zero_grad(set_to_none=True)
    loss_of(net).backward()
    assert_same(grads(net), grads(plain))

    # A graph recorded while the modifier was on, backpropagated after it was removed: unchanged too.
    net.zero_grad(set_to_none=True)
    with scale_grad(net[2], 5.0):
        loss = loss_of(net)
    loss.backward()
    assert_same(grads(net), grads(plain))


def test_inputs_and_parameters_passed_through_are_copied_not_hooked() -> None:
    weight = nn.Parameter(torch.ones(3))

    class Returns(nn.Module):
        def forward(self) -> torch.Tensor:
            return weight

    module = Returns()
    with scale_grad(module, 3.0):
        for _ in range(3):
            out = module()
            assert out is not weight and out.grad_fn is not None
            out.mul_(2)  # changes the copy, never the parameter
            (out * 2).sum().backward()
        assert not weight._backward_hooks
    torch.testing.assert_close(weight.grad, torch.full((3,), 3 * 3.0 * 2 * 2))
    torch.testing.assert_close(weight.detach(), torch.ones(3))

    # An in-place activation returns its input: the caller's tensor must not change behind autograd's back.
    relu = nn.ReLU(inplace=True)
    x = torch.tensor([-1.0, 2.0], requires_grad=True)
    with reverse_grad(relu):
        h = x * 1
        out = relu(h)
        out.add_(1)
        (out.sum() + (h * 5).sum()).backward()
    torch.testing.assert_close(x.grad, torch.tensor([0.0, -1.0]) + 5 * (torch.tensor([-1.0, 2.0]) > 0))


def test_structured_outputs_and_deep_copies() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            y = self.lin(x)
            return {"a": y, "b": y * 2, "index": y.argmax(dim=1)}

    pair = Pair()
    x = torch.ones(1, 2)
    with reverse_grad(pair):
        out = pair(x)
        (out["a"].sum() + out["b"].sum()).backward()
        copied = copy.deepcopy(pair)  # a copy: its hook is inert, it is never modified
    # b is computed from a inside the module: each gradient is reversed once where it enters the module.
    expected = -(torch.ones(1, 2) * 3).T @ x
    torch.testing.assert_close(pair.lin.weight.grad, expected)
    assert out["index"].dtype == torch.int64 and out["index"].grad_fn is None
    out = copied(x)
    (out["a"].sum() + out["b"].sum()).backward()
    torch.testing.assert_close(copied.lin.weight.grad, -expected)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda n: scale_grad(n, float("nan")), fh.InvalidValueError, "finite"),
        (lambda n: scale_grad(n, float("inf")), fh.InvalidValueError, "finite"),
        (lambda n: scale_grad(n, "2"), fh.InvalidTypeError, "real number"),
        (lambda n: scale_grad(n, True), fh.InvalidTypeError, "real number"),
        (lambda n: scale_grad(n, torch.tensor(2.0)), fh.InvalidTypeError, "real number"),
        (lambda n: clip_grad(n, 0.0), fh.InvalidValueError, "> 0"),
        (lambda n: clip_grad(n, -1), fh.InvalidValueError, "> 0"),
        (lambda n: clip_grad(n, float("inf")), fh.InvalidValueError, "finite"),
        (lambda n: reverse_grad(n, -1.0), fh.InvalidValueError, "scale_grad"),
        (lambda n: scale_grad(3, 1.0), fh.InvalidTypeError, "nn.Module"),
        (lambda n: scale_grad("layer1", 1.0), fh.InvalidTypeError, "nn.Module"),
        (lambda n: scale_grad(nn.ModuleList([n[0]]), 1.0), fh.InvalidValueError, "no forward of its own"),
        (lambda n: scale_grad([], 1.0), fh.InvalidValueError, "empty"),
        (lambda n: scale_grad([n[0].weight, "bias"], 1.0), fh.InvalidTypeError, "item 1 is a str"),
        (lambda n: scale_grad(n.named_parameters(), 1.0), fh.InvalidTypeError, "pass parameters()"),
        (lambda n: scale_grad([n[0].weight * 2], 1.0), fh.InvalidValueError, "pass the module"),
        (
            lambda n: scale_grad(nn.Linear(2, 2).requires_grad_(False).parameters(), 1.0),
            fh.InvalidValueError,
            "requires grad",
        ),
    ],
)
def test_bad_arguments_are_refused_clearly(call: Callable[[nn.Module], GradModifier], error: type, match: str) -> None:
    net = make_net()
    with pytest.raises(error, match=match):
        call(net)
    assert hook_count(net) == 0
    assert issubclass(error, fh.FeatureHooksError)


def test_modifiers_compose_with_watch_in_registration_order() -> None:
    """watch put on before a modifier reads the modified gradient; put on after, the gradient as it arrives."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    x = torch.randn(5, 4)
    out = model[0](x).detach().requires_grad_(True)
    (arriving,) = torch.autograd.grad(model[1](out).pow(2).sum(), out)

    def watched_grad_mean(watch_first: bool) -> float:
        if watch_first:
            probe = fh.watch(model, ["0"], grads=True)
            modifier = fh.scale_grad(model[0], 3.0)
        else:
            modifier = fh.scale_grad(model[0], 3.0)
            probe = fh.watch(model, ["0"], grads=True)
        with probe, modifier:
            model(x).pow(2).sum().backward()
            (row,) = [r for r in probe.summary() if r.kind == "grad"]
        model.zero_grad()
        return row.mean

    assert watched_grad_mean(watch_first=True) == pytest.approx(3.0 * arriving.mean().item(), rel=1e-5)
    assert watched_grad_mean(watch_first=False) == pytest.approx(arriving.mean().item(), rel=1e-5)
