"""Early exit, hook lifetime, freezing, grad/detach modes and what the extractor adds to a parent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import featurehooks as fh


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def execution_order(model: nn.Module, run) -> list[str]:
    """Module paths in the order their forward started during ``run()``."""
    order: list[str] = []
    handles = [
        module.register_forward_pre_hook(lambda _m, _a, path=path: order.append(path))
        for path, module in model.named_modules()
        if path
    ]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return order


class OneConv(nn.Module):
    """A 1x1 convolution ``conv``, for models whose ``forward`` defeats the meta dry run (``.item()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)


@pytest.fixture(scope="module")
def vgg(vgg16_cached: Path) -> fh.FeatureExtractor:
    return fh.FeatureExtractor("vgg16", ["relu1_2", "relu3_3"])


def test_early_exit_runs_nothing_after_the_deepest_tap(vgg: fh.FeatureExtractor, images: torch.Tensor) -> None:
    order = execution_order(vgg.backbone, lambda: vgg(images))
    assert order[-1] == "features.15"
    assert "features.16" not in order and "classifier" not in order


def test_early_exit_matches_a_full_run(vgg16_cached: Path, images: torch.Tensor) -> None:
    full = fh.FeatureExtractor("vgg16", ["relu1_2", "relu3_3"], early_exit=False)
    order = execution_order(full.backbone, lambda: full(images))
    assert "classifier.6" in order
    early = fh.FeatureExtractor("vgg16", ["relu1_2", "relu3_3"])
    for name, value in early(images).items():
        assert torch.equal(value, full(images)[name])


def test_early_exit_grad_matches_truncated_sequential(vgg16_cached: Path, images: torch.Tensor) -> None:
    extractor = fh.FeatureExtractor("vgg16", ["relu3_3"], mode="grad")
    truncated = nn.Sequential(*list(extractor.backbone.features)[:16])
    x1, x2 = images.clone().requires_grad_(), images.clone().requires_grad_()
    extractor(x1)["relu3_3"].square().sum().backward()
    truncated(extractor.normalize(x2)).square().sum().backward()
    assert torch.equal(x1.grad, x2.grad)


def test_close_removes_every_hook(vgg16_cached: Path, images: torch.Tensor) -> None:
    extractor = fh.FeatureExtractor("vgg16", ["relu2_2", "conv4_1"])
    assert hook_count(extractor.backbone) == 2
    extractor.close()
    assert hook_count(extractor.backbone) == 0
    extractor.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        extractor(images)


def test_with_block_removes_hooks_also_after_an_exception(vgg16_cached: Path) -> None:
    with fh.FeatureExtractor("vgg16", ["relu2_2"]) as extractor:
        assert hook_count(extractor.backbone) == 1
    assert hook_count(extractor.backbone) == 0

    with pytest.raises(ValueError, match="channels"), fh.FeatureExtractor("vgg16", ["relu2_2"]) as failing:
        failing(torch.rand(1, 5, 32, 32))
    assert hook_count(failing.backbone) == 0


def test_exception_mid_forward_leaves_the_extractor_usable(images: torch.Tensor) -> None:
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.fail = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.conv(x)
            if self.fail:
                raise RuntimeError("boom")
            return x.relu()

    with fh.FeatureExtractor(Fails(), ["conv"], early_exit=False) as extractor:
        extractor.backbone.fail = True
        with pytest.raises(RuntimeError, match="boom"):
            extractor(images)
        extractor.backbone.fail = False
        assert extractor(images)["conv"].shape == (2, 4, 62, 62)
    assert hook_count(extractor.backbone) == 0


def test_backbone_stays_frozen_and_in_eval_under_a_parent(vgg16_cached: Path, images: torch.Tensor) -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Conv2d(3, 3, 1)
            self.features = fh.FeatureExtractor("vgg16", ["relu2_2"], mode="grad")

    parent = Model().train()
    parent.apply(lambda m: nn.init.zeros_(m.weight) if isinstance(m, nn.Conv2d) else None)
    parent.requires_grad_(True)
    backbone = parent.features.backbone
    assert not backbone.training
    assert not any(p.requires_grad for p in backbone.parameters())
    assert backbone.features[0].weight.abs().sum() > 0, "a parent's apply() must not reach the backbone"
    assert [name for name, _ in parent.named_parameters()] == ["head.weight", "head.bias"]
    assert set(parent.state_dict()) == {"head.weight", "head.bias"}


def test_grad_mode_gives_the_input_a_gradient_and_the_backbone_none(vgg16_cached: Path, images: torch.Tensor) -> None:
    extractor = fh.FeatureExtractor("vgg16", ["relu2_2"], mode="grad")
    x = images.clone().requires_grad_()
    extractor(x)["relu2_2"].mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(p.grad is None for p in extractor.backbone.parameters())


def test_detach_mode_returns_no_graph(vgg: fh.FeatureExtractor, images: torch.Tensor) -> None:
    out = vgg(images.clone().requires_grad_())
    assert all(not t.requires_grad and t.grad_fn is None for t in out.values())


def test_buffers_follow_to_and_stay_out_of_state_dict(vgg16_cached: Path, images: torch.Tensor) -> None:
    extractor = fh.FeatureExtractor("vgg16", ["relu1_2"]).to(torch.float64)
    assert extractor.mean.dtype == torch.float64
    assert next(extractor.backbone.parameters()).dtype == torch.float64
    assert extractor(images.double())["relu1_2"].dtype == torch.float64
    assert extractor.state_dict() == {}


@pytest.mark.slow
def test_normalization_comes_from_the_weights(vgg16_cached: Path, seeded_weights) -> None:
    v1 = fh.FeatureExtractor("vgg16", ["relu1_2"])
    assert v1.preprocessing.mean == pytest.approx((0.485, 0.456, 0.406))
    seeded_weights("vgg16", "IMAGENET1K_FEATURES")
    features = fh.FeatureExtractor("vgg16", ["relu1_2"], weights="IMAGENET1K_FEATURES")
    assert features.preprocessing.std == pytest.approx((1 / 255,) * 3)
    assert features.std.flatten().tolist() == pytest.approx([1 / 255] * 3)


def test_input_range_maps_onto_the_same_features(vgg: fh.FeatureExtractor, vgg16_cached: Path, images) -> None:
    signed = fh.FeatureExtractor("vgg16", ["relu1_2", "relu3_3"], input_range=(-1, 1))
    bytes_ = fh.FeatureExtractor("vgg16", ["relu1_2", "relu3_3"], input_range=(0, 255))
    for name, value in vgg(images).items():
        torch.testing.assert_close(signed(images * 2 - 1)[name], value, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(bytes_(images * 255)[name], value, rtol=1e-4, atol=1e-4)


def test_a_call_past_the_last_one_is_refused_with_the_real_names(resnet18_cached: Path) -> None:
    names = r"runs 2 time\(s\) per forward, named layer1.0.relu, layer1.0.relu_1$"
    with pytest.raises(fh.LayerNotFoundError, match=names):
        fh.FeatureExtractor("resnet18", ["layer1.0.relu_2"])


def test_each_call_of_an_untraceable_module_is_its_own_tap(images: torch.Tensor) -> None:
    class Shared(OneConv):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            scale = y.sum().item()  # .item() cannot run on meta tensors, so there is no trace
            return self.conv(y) * scale

    module = Shared()
    extractor = fh.FeatureExtractor(module, ["conv_1", "conv"])
    out = extractor(images)
    first = module.conv(images)
    torch.testing.assert_close(out["conv"], first.detach())
    torch.testing.assert_close(out["conv_1"], module.conv(first).detach())
    with pytest.raises(RuntimeError, match="cannot run on the meta device"):
        _ = extractor.feature_info


def test_in_place_change_found_at_runtime_is_cloned_with_a_warning(images: torch.Tensor) -> None:
    class InPlace(OneConv):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            y.relu_()
            return y * y.sum().item()  # defeats the meta dry run

    module = InPlace()
    extractor = fh.FeatureExtractor(module, ["conv"], early_exit=False)
    with pytest.warns(UserWarning, match="changed in place"):
        first = extractor(images)["conv"]
    second = extractor(images)["conv"]
    expected = module.conv(images).detach()
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["detach", "grad"])
def test_compiles_to_one_graph_with_early_exit(vgg16_cached: Path, images: torch.Tensor, mode: str) -> None:
    extractor = fh.FeatureExtractor("vgg16", ["conv1_2", "relu2_2"], mode=mode)
    compiled = torch.compile(extractor, fullgraph=True, backend="eager")  # fullgraph: a graph break is an error
    x = images.clone().requires_grad_(mode == "grad")
    out = compiled(x)
    expected = extractor(images)
    for name, value in expected.items():
        torch.testing.assert_close(out[name], value)
    if mode == "grad":
        out["relu2_2"].sum().backward()
        assert x.grad is not None


@pytest.mark.slow
def test_compiled_first_call_then_a_recompile(vgg16_cached: Path, images: torch.Tensor) -> None:
    """The per-thread forward stack first created inside a compiled frame must not fail the recompile's guard."""
    torch._dynamo.reset()
    extractor = fh.FeatureExtractor("vgg16", ["relu1_2"], mode="grad")
    compiled = torch.compile(extractor, fullgraph=True, backend="eager")
    with torch.no_grad():
        first = compiled(images)["relu1_2"]
    second = compiled(images.clone().requires_grad_(True))["relu1_2"]  # grad mode: a recompile
    torch.testing.assert_close(first, second.detach())
    assert second.requires_grad


def test_deepcopy_and_pickle_give_independent_working_extractors(vgg16_cached: Path, images: torch.Tensor) -> None:
    import copy
    import io

    extractor = fh.FeatureExtractor("vgg16", ["conv1_2", "relu2_2"])
    expected = extractor(images)
    duplicate = copy.deepcopy(extractor)
    buffer = io.BytesIO()
    torch.save(extractor, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)  # our own object: trusted
    for copied in (duplicate, restored):
        out = copied(images)
        for name, value in expected.items():
            assert torch.equal(out[name], value)
    duplicate.close()
    assert hook_count(duplicate.backbone) == 0 and hook_count(extractor.backbone) == 2
    assert torch.equal(extractor(images)["relu2_2"], expected["relu2_2"])


def test_early_exit_survives_a_forward_that_catches_every_exception(images: torch.Tensor) -> None:
    class Guarded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1)
            self.ran_second = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            try:
                x = self.first(x)
            except Exception:  # a model's own error handling must not swallow the early exit
                pass
            self.ran_second = True
            return self.second(x)

    extractor = fh.FeatureExtractor(Guarded(), ["first"])
    assert extractor(images)["first"].shape == (2, 3, 64, 64)
    assert not extractor.backbone.ran_second
