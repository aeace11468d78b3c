"""The user's code runs once, as the user wrote it: ``memory_format="auto"`` never runs a forward twice and passes
every exception of the user's module through unchanged; the meta trace never calls the user's hooks (the module's
own or global ones); ``capture`` refuses TorchScript, where hooks never fire; a torchvision instance that gets no
resize or crop from its weights says so, once."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torchvision.models as tvm
from torch import Tensor, nn

import featurehooks as fh
from featurehooks.errors import InvalidTypeError

SIDE = 64  # 4096 pixels: "auto" runs the convolutions below channels-last at this size (each weight used >= 1000x)


def channels_last(x: Tensor) -> bool:
    """Whether ``x`` has channels-last strides that are not also NCHW ones."""
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


class Counted(nn.Module):
    """A convolution net that counts its real forwards and draws random noise in each, as a user's model with
    dropout-like noise or a counter would; it raises ``failure`` in each real forward. Both are class attributes,
    which the extractor's private copy shares."""

    real_forwards = 0
    failure: BaseException | None = None

    def __init__(self, refuse_channels_last: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 4, 3, padding=1)
        self.refuse_channels_last = refuse_channels_last

    def forward(self, x: Tensor) -> Tensor:
        if self.refuse_channels_last and channels_last(x):
            raise ValueError("this model takes NCHW images")  # a user's layout check
        if not x.is_meta:
            Counted.real_forwards += 1
            if Counted.failure is not None:
                raise Counted.failure
        features = self.conv(x)
        noise = torch.rand_like(features) + torch.rand(())  # a draw on the images' device, and one on the CPU
        return self.head(features + noise)


class ViewsAfterConv(Counted):
    """Runs in NCHW; in channels-last the ``.view`` of the convolution's output, before ``flat``, fails."""

    def __init__(self) -> None:
        super().__init__()
        self.flat = nn.Linear(4 * SIDE * SIDE, 2)

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        return self.flat(out.view(out.shape[0], -1))


def plain(model: nn.Module, images: Tensor) -> Tensor:
    """The model's own forward, as a user runs it."""
    with torch.no_grad():
        return model.eval()(images)


@pytest.fixture(autouse=True)
def _no_count() -> Iterator[None]:
    Counted.real_forwards, Counted.failure = 0, None
    yield
    Counted.failure = None


def test_auto_runs_nchw_once_for_a_model_whose_view_fails_in_channels_last() -> None:
    torch.manual_seed(0)
    model = ViewsAfterConv()
    images = torch.rand(2, 3, SIDE, SIDE)
    extractor = fh.FeatureExtractor(model, ["flat"], weights=None)
    assert extractor.memory_format_for(images.shape) == "contiguous" and extractor.conv_work is None
    torch.manual_seed(1)
    expected = plain(model, images)
    Counted.real_forwards = 0
    torch.manual_seed(1)
    got = extractor(images)["flat"]
    assert Counted.real_forwards == 1  # one forward: the noise drawn once, as in plain PyTorch
    assert torch.equal(got, expected)


def test_a_layout_check_raising_value_error_keeps_auto_in_nchw() -> None:
    torch.manual_seed(0)
    model = Counted(refuse_channels_last=True)
    images = torch.rand(2, 3, SIDE, SIDE)
    extractor = fh.FeatureExtractor(model, ["head"], weights=None)
    assert extractor.memory_format_for(images.shape) == "contiguous"
    torch.manual_seed(1)
    expected = plain(model, images)
    torch.manual_seed(1)
    assert torch.equal(extractor(images)["head"], expected)


def test_a_model_that_runs_channels_last_still_runs_it_under_auto_and_draws_as_plain_pytorch() -> None:
    torch.manual_seed(0)
    model = Counted()
    images = torch.rand(2, 3, SIDE, SIDE)
    extractor = fh.FeatureExtractor(model, ["head"], weights=None)
    torch.manual_seed(1)
    expected = plain(model, images.contiguous(memory_format=torch.channels_last))  # as "auto" runs it
    torch.manual_seed(1)
    got = extractor(images)["head"]  # checks channels-last on the meta device first: no draw of the CPU's is used
    assert extractor.memory_format_in_use == "channels_last" and Counted.real_forwards == 2
    assert torch.equal(got, expected)


class Mine(RuntimeError):
    """An error of the user's own, a RuntimeError as many are."""


@pytest.mark.parametrize("error", [Mine("mine"), ValueError("bad batch"), AssertionError("shape")])
@pytest.mark.parametrize("memory_format", ["auto", "contiguous", "channels_last"])
def test_the_users_exception_passes_through_unchanged_after_one_forward(error: Exception, memory_format: str) -> None:
    extractor = fh.FeatureExtractor(Counted(), ["head"], weights=None, memory_format=memory_format)
    Counted.failure = error
    images = torch.rand(2, 3, SIDE, SIDE)
    if memory_format == "auto":
        assert extractor.memory_format_for(images.shape) == "channels_last"
    with pytest.raises(type(error)) as info:
        extractor(images)
    assert info.value is error and type(info.value) is type(error) and Counted.real_forwards == 1
    with pytest.raises(type(error)):
        extractor(images)
    assert Counted.real_forwards == 2
    if memory_format == "auto":  # a failure changes nothing about the next forward's format
        assert extractor.memory_format_for(images.shape) == "channels_last"


class Hooked:
    """Forward hooks and pre-hooks of a user on ``model``, and global module hooks, recording what they were
    called with: ``"meta"`` for a meta tensor, ``"real"`` for any other."""

    def __init__(self, model: nn.Module) -> None:
        self.seen: dict[str, list[str]] = {"hook": [], "pre": [], "global": [], "global_pre": []}
        self.handles = [
            model.conv.register_forward_hook(lambda _m, _a, out: self._note("hook", out)),
            model.conv.register_forward_pre_hook(lambda _m, args: self._note("pre", args[0])),
            torch.nn.modules.module.register_module_forward_hook(lambda _m, _a, out: self._note("global", out)),
            torch.nn.modules.module.register_module_forward_pre_hook(
                lambda _m, args: self._note("global_pre", args[0] if args else None)
            ),
        ]

    def _note(self, kind: str, value: Any) -> None:
        if isinstance(value, Tensor):
            self.seen[kind].append("meta" if value.is_meta else "real")

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def test_the_meta_trace_never_calls_the_users_hooks() -> None:
    model = Counted()
    hooked = Hooked(model)
    try:
        extractor = fh.FeatureExtractor(model, ["head"], weights=None)
        assert extractor.memory_format_for((2, 3, SIDE, SIDE)) == "channels_last"  # checked on the meta device
        extractor.output_shapes((1, 3, 32, 32))  # another shape: traced again
        fh.list_layers(model)
        assert all(seen == [] for seen in hooked.seen.values()), hooked.seen
        extractor(torch.rand(1, 3, 16, 16))  # the real forward runs the hooks the private copy carries, once each
        assert hooked.seen["hook"] == ["real"] and hooked.seen["pre"] == ["real"]
        assert "meta" not in hooked.seen["global"] + hooked.seen["global_pre"]
        for seen in hooked.seen.values():
            seen.clear()
        with fh.capture(model, ["conv"]) as feats:  # its first forward is traced on the meta device
            model(torch.rand(1, 3, 16, 16))
        assert hooked.seen["hook"] == ["real"] and hooked.seen["pre"] == ["real"] and list(feats) == ["conv"]
        assert "meta" not in hooked.seen["global"] + hooked.seen["global_pre"]
    finally:
        hooked.remove()


def test_the_users_hook_objects_are_never_copied_into_the_trace() -> None:
    """A hook object of the user's is never copied either: one that cannot be deep-copied no longer stops a trace."""

    class Unpicklable:
        def __deepcopy__(self, memo: dict[int, Any]) -> Any:
            raise TypeError("cannot copy a lock")

        def __call__(self, _module: nn.Module, _args: Any, out: Tensor) -> None:
            assert not out.is_meta

    model = Counted()
    model.conv.register_forward_hook(Unpicklable())
    assert [info.name for info in fh.list_layers(model)] == ["conv", "head"]


def _traced_and_scripted() -> list[Any]:
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 1, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated
        return [torch.jit.trace(net, torch.rand(1, 3, 16, 16)), torch.jit.script(net)]


@pytest.mark.parametrize("module", _traced_and_scripted(), ids=["traced", "scripted"])
def test_capture_and_the_extractor_refuse_a_torchscript_module(module: nn.Module) -> None:
    refused = pytest.raises(InvalidTypeError, match="TorchScript.*hooks do not fire.*capture the eager module")
    with refused, fh.capture(module, ["0", "2"]):
        module(torch.rand(1, 3, 16, 16))
    with pytest.raises(InvalidTypeError, match="FeatureExtractor: .*TorchScript.*pass the eager module"):
        fh.FeatureExtractor(module, ["0"], weights=None)


def test_capture_refuses_a_layer_inside_torchscript_and_taps_the_eager_rest() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                self.enc = torch.jit.script(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()))
            self.head = nn.Conv2d(4, 1, 1)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.enc(x))

    outer = Outer()
    for layers in (["enc"], ["enc.0"]):
        with pytest.raises(InvalidTypeError, match="'enc' is a TorchScript module"), fh.capture(outer, layers):
            pass
    with fh.capture(outer, ["head"]) as feats:
        outer(torch.rand(1, 3, 16, 16))
    assert tuple(feats["head"].shape) == (1, 1, 14, 14)


def test_a_finetuned_torchvision_instance_warns_once_that_it_gets_no_resize_or_crop() -> None:
    model = tvm.resnet18(num_classes=10)  # no builder's DEFAULT architecture: the ResNet builders resize apart
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extractor = fh.FeatureExtractor(model, ["layer1"])
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1, messages
    assert "ResNet instance gets no resize or crop" in messages[0] and "resize_size=" in messages[0]
    assert "\n" not in messages[0]
    assert (extractor.preprocessing.resize_size, extractor.preprocessing.crop_size) == (None, None)


def test_instances_that_get_their_preprocessing_or_need_none_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fh.FeatureExtractor(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), ["1"])  # a user's module: none expected
        with torch.device("meta"):
            alexnet = tvm.alexnet(num_classes=10)  # one builder: its preprocessing applies
        fh.load_backbone(alexnet)
