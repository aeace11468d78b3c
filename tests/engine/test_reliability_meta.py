"""Copies of a model leave the data it merely references alone; timm models that fill buffers list (#7, #12)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import featurehooks as fh
from featurehooks._copy import meta_copy
from featurehooks.backbones._meta import meta_parameters, meta_tensor_names


class _Trainer:
    """Stands for a training loop's object that a model keeps a reference to."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data


class _Referencing(nn.Module):
    """A small CNN that references data it never needs: a dataset attribute, a trainer, a cache of its last output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.register_buffer("offset", torch.full((1, 4, 1, 1), 0.5))
        self.dataset = torch.randn(64, 3, 8, 8)
        self.trainer = _Trainer(torch.randn(1000))
        self.history = {"first": torch.randn(10)}
        self.last = nn.Linear(2, 2)(torch.randn(1, 2))  # a result with grad: deepcopy refuses to copy it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x) + self.offset)


# -- item 7: referenced data is shared, not copied ---------------------------------------------------------
def test_the_meta_copy_copies_no_referenced_data() -> None:
    model = _Referencing()
    copied = meta_copy(model)
    referenced = [copied.dataset, copied.trainer.data, copied.history["first"], copied.last]
    assert all(tensor.is_meta for tensor in referenced)
    assert all(tensor.is_meta for tensor in [*copied.parameters(), *copied.buffers()])
    assert copied.trainer is not model.trainer and not model.trainer.data.is_meta  # the model keeps its data


def test_the_extractor_shares_referenced_tensors_and_copies_its_weights() -> None:
    model = _Referencing()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    extractor = fh.FeatureExtractor(model, layers=["conv"], weights=None)
    own = extractor.backbone
    for name, ours in model.state_dict().items():
        theirs = own.state_dict()[name]
        assert theirs.untyped_storage().data_ptr() != ours.untyped_storage().data_ptr(), name
        assert torch.equal(theirs, before[name]) and torch.equal(ours, before[name]), name
    assert own.dataset.untyped_storage().data_ptr() == model.dataset.untyped_storage().data_ptr()
    assert own.trainer.data.untyped_storage().data_ptr() == model.trainer.data.untyped_storage().data_ptr()
    assert own.history is not model.history  # containers are the copy's own: a forward's cache stays there
    assert own.history["first"] is model.history["first"]
    extractor(torch.rand(1, 3, 8, 8))
    assert model.training and all(p.requires_grad for p in model.parameters())  # the user's model is untouched
    assert all(not p.requires_grad for p in own.parameters())


# -- item 12: models that compute on their parameters' device while they are built --------------------------
class _TableFromWeightDevice(nn.Module):
    """Fills a real buffer with a table computed on its weight's device, as timm's Swin V2 attention does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("table", torch.empty(9, 2), persistent=False)
        self.register_buffer("steps", torch.arange(3.0), persistent=False)  # computed on the CPU: keeps its values
        grid = torch.stack(torch.meshgrid(*[torch.arange(3.0, device=self.proj.weight.device)] * 2, indexing="ij"))
        self.table.copy_(grid.flatten(1).T)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.table.sum()


class _ProbeForwardAtBuild(nn.Module):
    """Runs a CPU image through its own layers at build time to learn the feature size, as timm's HybridEmbed does."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.GroupNorm(2, 8), nn.ReLU())
        with torch.no_grad():
            self.feature_size = tuple(self.stem(torch.zeros(1, 3, 16, 16)).shape[-2:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stem(x)


def test_a_table_computed_on_the_parameters_device_builds_and_is_reported_without_values() -> None:
    with meta_parameters():
        model = _TableFromWeightDevice()
    assert model.table.is_meta and model.table.shape == (9, 2)
    assert torch.equal(model.steps, torch.arange(3.0))  # ops that work are left alone
    assert meta_tensor_names(model) == ["proj.weight", "proj.bias", "table"]  # a load would say it has no values


def test_a_probe_forward_at_build_time_runs_on_the_meta_device() -> None:
    with meta_parameters():
        model = _ProbeForwardAtBuild()
    assert model.feature_size == (7, 7)
    rows = {row.name: row for row in fh.list_layers(model, input_size=16)}
    assert (rows["stem.1"].channels, rows["stem.1"].stride) == (8, 2)


@pytest.mark.parametrize(
    ("name", "tap", "expected"),
    [
        # relative coordinates copied into a buffer from the weights' device
        ("swinv2_cr_tiny_ns_224", "stages.3", ("NCHW", 768, 32)),
        ("swinv2_tiny_window8_256", "layers.3", ("NHWC", 768, 32)),  # the same in timm's Swin V2
        ("vit_small_patch16_rope_mixed_224", "blocks.11", ("NLC", 384, 16)),  # mixed RoPE grid buffers
        ("vit_tiny_r_s16_p8_224", "blocks.11", ("NLC", 192, 32)),  # hybrid ViT: a probe forward at build time
    ],
)
def test_timm_models_that_compute_while_built_list_their_layers(
    name: str, tap: str, expected: tuple[str, int, int]
) -> None:
    pytest.importorskip("timm")
    (row,) = fh.list_layers(f"timm/{name}", include=[tap])
    assert (row.layout, row.channels, row.stride) == expected
