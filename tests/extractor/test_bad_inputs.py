"""Untrusted input gets a cast or one clear error: image dtypes, weights files, loss arguments, an offline hub."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.models as tvm
from safetensors.torch import save_file
from torch import nn

import featurehooks as fh
import featurehooks.losses as fl
from featurehooks.backbones import load_backbone
from featurehooks.errors import FeatureHooksError, InvalidTypeError, InvalidValueError

SIZE = 16


def tiny_net() -> nn.Module:
    """A seeded two-conv network: extractors over it build in milliseconds."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())


@pytest.fixture
def ext() -> fh.FeatureExtractor:
    """A grad-mode float32 extractor with a normalization, so the buffers take part in every cast."""
    return fh.FeatureExtractor(tiny_net(), ["1", "3"], mode="grad", mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3))


@pytest.fixture
def x() -> torch.Tensor:
    return torch.rand(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))


def one_line(info: pytest.ExceptionInfo) -> str:
    """The error's message, which must be a single line and a featurehooks error."""
    assert isinstance(info.value, FeatureHooksError), type(info.value)
    message = str(info.value)
    assert message and "\n" not in message, message
    return message


# -- 14: any floating dtype is cast to the extractor's -------------------------------------------------------


def test_float64_images_give_the_float32_result(ext: fh.FeatureExtractor, x: torch.Tensor) -> None:
    expected, found = ext(x), ext(x.double())
    for name in expected:
        assert found[name].dtype == torch.float32
        torch.testing.assert_close(found[name], expected[name])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_float32_images_run_in_the_extractors_dtype(ext: fh.FeatureExtractor, x: torch.Tensor, dtype) -> None:
    expected = ext(x)["3"]
    found = ext.to(dtype)(x)["3"]
    assert found.dtype == dtype and ext.mean.dtype == dtype
    tolerance = {torch.float64: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(found.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_module_of_another_dtype_sets_the_extractors(x: torch.Tensor, dtype) -> None:
    extractor = fh.FeatureExtractor(tiny_net().to(dtype), ["3"], mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3))
    assert extractor.mean.dtype == dtype
    for images in (x, x.double()):
        assert extractor(images)["3"].dtype == dtype


def test_gradients_reach_a_float64_leaf(ext: fh.FeatureExtractor, x: torch.Tensor) -> None:
    x32, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    ext(x32)["3"].square().sum().backward()
    ext(x64)["3"].square().sum().backward()
    assert x64.grad is not None and x64.grad.dtype == torch.float64
    torch.testing.assert_close(x64.grad.float(), x32.grad)


def test_autocast_keeps_choosing_the_precision(ext: fh.FeatureExtractor, x: torch.Tensor) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        found = ext(x.double())["3"]
    assert found.dtype == torch.bfloat16
    torch.testing.assert_close(found.float(), ext(x)["3"], rtol=5e-2, atol=5e-2)


def test_what_no_cast_can_fix_is_still_refused(ext: fh.FeatureExtractor, x: torch.Tensor) -> None:
    with pytest.raises(TypeError) as info:
        ext(x.to(torch.uint8))
    assert "uint8" in one_line(info)
    with pytest.raises(ValueError) as info:
        ext(torch.rand(1, 3, SIZE, SIZE, device="meta"))
    assert "meta" in one_line(info) and "cpu" in one_line(info)


def test_losses_take_float64_input_and_target(ext: fh.FeatureExtractor, x: torch.Tensor) -> None:
    y = torch.rand(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(2))
    for loss in (fl.PerceptualLoss(ext, ["1", "3"]), fl.StyleLoss(ext, ["1", "3"])):
        x64 = x.double().requires_grad_()
        value = loss(x64, y.double())
        value.backward()
        torch.testing.assert_close(value, loss(x, y))
        assert x64.grad is not None and x64.grad.dtype == torch.float64
    fixed = fl.StyleLoss(ext, ["1"], target=y[:1].double())
    torch.testing.assert_close(fixed(x.double()), fl.StyleLoss(ext, ["1"], target=y[:1])(x))


# -- 15: every unusable weights file is one WeightsUnavailableError naming the file ------------------------------


def _conv_state() -> dict[str, torch.Tensor]:
    return nn.Conv2d(3, 4, 3).state_dict()


def _write_truncated(path: Path) -> None:
    torch.save(_conv_state(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


BAD_FILES: dict[str, tuple[Callable[[Path], object], str]] = {
    "empty.pth": (lambda p: p.write_bytes(b""), "not a readable torch.save file"),
    "empty.safetensors": (lambda p: p.write_bytes(b""), "not a readable safetensors file"),
    "corrupt.safetensors": (lambda p: p.write_bytes(b"\x10" + bytes(7) + b"{not json}"), "safetensors"),
    "truncated.pth": (_write_truncated, "not a readable torch.save file"),
    "list.pth": (lambda p: torch.save([torch.zeros(1)], p), "holds a list"),
    "numbers.pth": (lambda p: torch.save({"a": 1, "b": "x"}, p), "'a' holds a value of type int"),
    "nested.pth": (lambda p: torch.save({"encoder": _conv_state()}, p), "nested state dict"),
    "no_tensors.pth": (lambda p: torch.save({}, p), "empty state dict"),
    "no_tensors.safetensors": (lambda p: save_file({}, str(p)), "empty state dict"),
    "folder.pth": (lambda p: p.mkdir(), "is a directory"),
    "pickled.pth": (lambda p: torch.save({"weight": torch.zeros(1), "path": Path("/")}, p), "pathlib.PosixPath"),
}


def _backbones() -> list[object]:
    found: list[object] = ["own", "resnet18"]
    try:
        import timm  # noqa: F401
    except ImportError:
        return found
    return [*found, "timm/resnet10t"]


def _load(backbone: object, path: Path) -> object:
    spec = nn.Conv2d(3, 4, 3) if backbone == "own" else backbone
    return load_backbone(spec, str(path))  # type: ignore[arg-type]


@pytest.mark.parametrize("backbone", _backbones())
@pytest.mark.parametrize("name", list(BAD_FILES))
def test_bad_weights_files_are_one_clear_error(tmp_path: Path, name: str, backbone: object) -> None:
    write, expected = BAD_FILES[name]
    path = tmp_path / name
    write(path)
    with pytest.raises(fh.WeightsUnavailableError) as info:
        _load(backbone, path)
    message = one_line(info)
    assert str(path) in message and expected in message, message


def _int_state(backbone: object) -> dict[str, torch.Tensor]:
    """A state dict of the right keys and shapes whose floating tensors were turned into integers."""
    if backbone == "own":
        model: nn.Module = nn.Conv2d(3, 4, 3)
    elif backbone == "resnet18":
        model = tvm.resnet18()
    else:
        import timm

        model = timm.create_model("resnet10t")
    return {key: value.round().to(torch.int64) for key, value in model.state_dict().items()}


@pytest.mark.parametrize("backbone", _backbones())
def test_integer_weights_for_float_parameters_are_refused(tmp_path: Path, backbone: object) -> None:
    path = tmp_path / "ints.safetensors"
    save_file(_int_state(backbone), str(path))
    with pytest.raises(fh.WeightsUnavailableError) as info:
        _load(backbone, path)
    assert "torch.int64" in one_line(info) and str(path) in one_line(info)


class _Payload:
    """Pickles as a call of os.mkdir: loading it with weights_only=False would create a folder."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (str(self.target),))


def test_a_pickle_with_code_is_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    path = tmp_path / "evil.pth"
    torch.save({"weight": torch.zeros(4, 3, 3, 3), "bias": _Payload(marker)}, path)
    for backbone in _backbones():
        with pytest.raises(fh.WeightsUnavailableError) as info:
            _load(backbone, path)
        assert "mkdir" in one_line(info) and "weights_only=True" in one_line(info)
    assert not marker.exists()


def test_an_unreadable_file_names_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "locked.pth"
    torch.save(_conv_state(), path)
    path.chmod(0)
    if os.access(path, os.R_OK):  # root reads anything: make torch.load fail the way open() would

        def denied(*args: object, **kwargs: object) -> None:
            raise PermissionError(13, "Permission denied", str(path))

        monkeypatch.setattr(torch, "load", denied)
    with pytest.raises(fh.WeightsUnavailableError) as info:
        _load("own", path)
    assert "Permission denied" in one_line(info) and str(path) in one_line(info)


def test_a_wrapped_checkpoint_is_unwrapped_at_any_depth(tmp_path: Path) -> None:
    state = _conv_state()
    path = tmp_path / "checkpoint.pth"
    torch.save({"model": {"state_dict": state}, "epoch": 3}, path)
    loaded = _load("own", path).model  # type: ignore[attr-defined]
    assert torch.equal(loaded.weight, state["weight"])


# -- 17: loss arguments and batches -------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [True, False])
def test_input_size_refuses_a_bool(ext: fh.FeatureExtractor, size: bool) -> None:
    with pytest.raises(TypeError) as info:
        fl.PerceptualLoss(ext, ["3"], input_size=size)
    assert "input_size" in one_line(info) and "bool" in one_line(info)


@pytest.mark.parametrize("size", [(True, 8), 8.0, "8", (8, 8, 8), (0, 8), -1, [8, None]])
def test_input_size_refuses_what_is_no_size(ext: fh.FeatureExtractor, size: object) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        fl.StyleLoss(ext, ["3"], input_size=size)  # type: ignore[arg-type]
    assert "input_size" in one_line(info) and repr(size) in one_line(info)


def test_input_size_takes_ints_of_any_kind(ext: fh.FeatureExtractor) -> None:
    assert fl.PerceptualLoss(ext, ["3"], input_size=np.int64(8)).input_size == (8, 8)
    assert fl.PerceptualLoss(ext, ["3"], input_size=[8, 12]).input_size == (8, 12)


def _empty() -> torch.Tensor:
    return torch.rand(0, 3, SIZE, SIZE)


def test_empty_batches_name_the_argument_and_shape(ext: fh.FeatureExtractor, x: torch.Tensor) -> None:
    loss = fl.PerceptualLoss(ext, ["3"])
    empty = f"empty batch, shape (0, 3, {SIZE}, {SIZE})"
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: loss(_empty(), _empty()), f"input is an {empty}"),
        (lambda: loss(x, _empty()), f"target is an {empty}"),
        (lambda: fl.StyleLoss(ext, ["3"], target=_empty()), f"target is an {empty}"),
        (lambda: fl.TotalVariationLoss()(_empty()), f"images is an {empty}"),
        (lambda: fl.LossGroup({"p": loss})(_empty(), x), f"input is an {empty}"),
        (
            lambda: loss.from_features({"3": torch.rand(0, 8, 4, 4)}, {"3": torch.rand(1, 8, 4, 4)}),
            "the input features of layer '3' is an empty batch, shape (0, 8, 4, 4)",
        ),
    ]
    for call, expected in cases:
        with pytest.raises(InvalidValueError) as info:
            call()
        assert expected in one_line(info), one_line(info)


@pytest.mark.parametrize(
    ("fake", "real", "expected"),
    [
        ([torch.tensor(1.0)], [torch.tensor(2.0)], "fake feature '0' is a 0-D tensor"),
        ({"x": torch.rand(2, 4)}, {"x": torch.tensor(2.0)}, "real feature 'x' is a 0-D tensor"),
        ([torch.rand(0, 4)], [torch.rand(0, 4)], "fake feature '0' is an empty batch, shape (0, 4)"),
    ],
)
def test_feature_matching_names_scalars_and_empty_batches(fake: object, real: object, expected: str) -> None:
    with pytest.raises(InvalidValueError) as info:
        fl.FeatureMatchingLoss()(fake, real)  # type: ignore[arg-type]
    assert expected in one_line(info)


def test_loss_errors_keep_their_builtin_classes(ext: fh.FeatureExtractor) -> None:
    with pytest.raises(InvalidTypeError):
        fl.PerceptualLoss(ext, ["3"])("not an image", torch.rand(1, 3, SIZE, SIZE))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        fl.PerceptualLoss(ext, ["3"], reduction="avg")  # type: ignore[arg-type]


# -- 18: an unreachable or forbidden hub fails in seconds, naming HF_HUB_OFFLINE=1 ---------------------------------


def test_offline_timm_weights_fail_at_once_with_the_hint() -> None:
    pytest.importorskip("timm")
    started = time.monotonic()
    with pytest.raises(fh.WeightsUnavailableError) as info:
        fh.FeatureExtractor("timm/convnext_tiny", ["stages.2"])
    assert time.monotonic() - started < 5
    assert "HF_HUB_OFFLINE=1" in one_line(info) and "convnext_tiny" in one_line(info)


def test_the_variable_is_honoured_when_set_after_import(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("timm")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # huggingface_hub read the variable at import
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _refuse_network(monkeypatch)
    with pytest.raises(fh.WeightsUnavailableError, match="HF_HUB_OFFLINE=1 forbids"):
        load_backbone("timm/resnet10t")


def _refuse_network(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make the hub unreachable: the one request featurehooks makes fails like a DNS lookup offline."""
    import huggingface_hub

    asked: list[str] = []

    def unreachable(url: str, **kwargs: object) -> None:
        asked.append(url)
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", unreachable)
    return asked


def test_an_unreachable_hub_fails_after_one_request(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("timm")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    asked = _refuse_network(monkeypatch)
    started = time.monotonic()
    with pytest.raises(fh.WeightsUnavailableError) as info:
        load_backbone("timm/resnet10t")
    assert time.monotonic() - started < 5 and len(asked) == 1
    assert "cannot be reached" in one_line(info) and "HF_HUB_OFFLINE=1" in one_line(info)


def _cache_hub_file(cache: Path, repo: str, state: dict[str, torch.Tensor]) -> None:
    """Lay out ``state`` as huggingface_hub caches ``model.safetensors`` of ``repo`` at revision main."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    commit = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    save_file(state, str(snapshot / "model.safetensors"))


def test_cached_hub_weights_load_without_the_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timm = pytest.importorskip("timm")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    asked = _refuse_network(monkeypatch)
    torch.manual_seed(5)
    state = timm.create_model("resnet10t").state_dict()
    _cache_hub_file(tmp_path, timm.models.get_pretrained_cfg("resnet10t").hf_hub_id, state)
    model = load_backbone("timm/resnet10t").model
    assert torch.equal(model.fc.weight, state["fc.weight"]) and asked == []
