"""Question: does early exit on a live module cost what CUT's own ``encode_only`` forward costs?

CUT's PatchNCE loss (Park et al., Contrastive Learning for Unpaired Image-to-Image Translation, ECCV 2020) takes the
features of the generator it trains from the first 17 layers of its ``nn.Sequential`` and stops there:
``netG(x, nce_layers, encode_only=True)``, a forward written for it. Forward and backward of a loss on those features,
with the generator in train mode (CUT's default instance norm), for:

- CUT encode_only (the floor): the generator's own truncated forward;
- intermediates: ``featurehooks.intermediates(netG, x, ["model.0", "model.4", ...])`` on the plain forward,
  which stops after ``model.16``;
- capture (full forward): the same taps through ``fh.capture``, where the whole generator runs.

    python benchmarks/live_exit.py --threads 2 --no-plot   # seconds
    python benchmarks/live_exit.py --quick                 # checks the script
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import featurehooks as fh
from featurehooks import intermediates

import _harness as H
import _report as R

CUT = "CUT encode_only"
OURS = "intermediates"
CAPTURE = "capture (full forward)"
NCE_LAYERS = [0, 4, 8, 12, 16]  # CUT's --nce_layers default
SPEED = 0.98  # intermediates at least this fast as CUT's own encode_only forward
SHAPES = H.Shapes(quick="1x32", cpu="1x128", cuda="1x256")


# --------------------------------------------------------------------------------------------------
# CUT's generator, as taesungpark/contrastive-unpaired-translation models/networks.py defines it (BSD licence):
# ResnetGenerator with its anti-aliased Downsample/Upsample, ResnetBlock, and forward(input, layers, encode_only)


def get_filter(filt_size: int = 3) -> Tensor:
    a = {1: [1.0], 2: [1.0, 1.0], 3: [1.0, 2.0, 1.0], 4: [1.0, 3.0, 3.0, 1.0], 5: [1.0, 4.0, 6.0, 4.0, 1.0],
         6: [1.0, 5.0, 10.0, 10.0, 5.0, 1.0], 7: [1.0, 6.0, 15.0, 20.0, 15.0, 6.0, 1.0]}[filt_size]  # fmt: skip
    row = np.array(a)
    filt = torch.Tensor(row[:, None] * row[None, :])
    return filt / torch.sum(filt)


def get_pad_layer(pad_type: str) -> Callable[..., nn.Module]:
    return {"refl": nn.ReflectionPad2d, "reflect": nn.ReflectionPad2d, "repl": nn.ReplicationPad2d,
            "replicate": nn.ReplicationPad2d, "zero": nn.ZeroPad2d}[pad_type]  # fmt: skip


class Downsample(nn.Module):
    def __init__(self, channels: int, pad_type: str = "reflect", filt_size: int = 3, stride: int = 2) -> None:
        super().__init__()
        self.filt_size = filt_size
        half = int(1.0 * (filt_size - 1) / 2)
        up = int(np.ceil(1.0 * (filt_size - 1) / 2))
        self.stride = stride
        self.register_buffer("filt", get_filter(filt_size)[None, None, :, :].repeat((channels, 1, 1, 1)))
        self.pad = get_pad_layer(pad_type)([half, up, half, up])

    def forward(self, inp: Tensor) -> Tensor:
        if self.filt_size == 1:
            return inp[:, :, :: self.stride, :: self.stride]
        return F.conv2d(self.pad(inp), self.filt, stride=self.stride, groups=inp.shape[1])


class Upsample(nn.Module):
    def __init__(self, channels: int, pad_type: str = "repl", filt_size: int = 4, stride: int = 2) -> None:
        super().__init__()
        self.filt_odd = np.mod(filt_size, 2) == 1
        self.pad_size = int((filt_size - 1) / 2)
        self.stride = stride
        filt = get_filter(filt_size) * (stride**2)
        self.register_buffer("filt", filt[None, None, :, :].repeat((channels, 1, 1, 1)))
        self.pad = get_pad_layer(pad_type)([1, 1, 1, 1])

    def forward(self, inp: Tensor) -> Tensor:
        padded = self.pad(inp)
        ret_val = F.conv_transpose2d(
            padded, self.filt, stride=self.stride, padding=1 + self.pad_size, groups=inp.shape[1]
        )[:, :, 1:, 1:]
        return ret_val if self.filt_odd else ret_val[:, :, :-1, :-1]


class ResnetBlock(nn.Module):
    def __init__(self, dim: int, norm_layer: Callable[[int], nn.Module], use_dropout: bool, use_bias: bool) -> None:
        super().__init__()
        block: list[nn.Module] = [nn.ReflectionPad2d(1), nn.Conv2d(dim, dim, 3, bias=use_bias), norm_layer(dim)]
        block += [nn.ReLU(True)] + ([nn.Dropout(0.5)] if use_dropout else [])
        block += [nn.ReflectionPad2d(1), nn.Conv2d(dim, dim, 3, bias=use_bias), norm_layer(dim)]
        self.conv_block = nn.Sequential(*block)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv_block(x)  # add skip connections


class ResnetGenerator(nn.Module):
    """CUT's generator (``resnet_9blocks`` with ``n_blocks=9``); ``norm`` is CUT's ``--normG``."""

    def __init__(
        self, input_nc: int = 3, output_nc: int = 3, ngf: int = 64, norm: str = "instance", use_dropout: bool = False,
        n_blocks: int = 9,
    ) -> None:  # fmt: skip
        super().__init__()
        if norm == "instance":  # CUT's get_norm_layer
            norm_layer: Callable[[int], nn.Module] = functools.partial(nn.InstanceNorm2d, affine=False)
        else:
            norm_layer = functools.partial(nn.BatchNorm2d, affine=True, track_running_stats=True)
        use_bias = norm == "instance"
        model: list[nn.Module] = [
            nn.ReflectionPad2d(3),
            nn.Conv2d(input_nc, ngf, kernel_size=7, padding=0, bias=use_bias),
            norm_layer(ngf),
            nn.ReLU(True),
        ]
        for i in range(2):  # downsampling, anti-aliased
            mult = 2**i
            model += [
                nn.Conv2d(ngf * mult, ngf * mult * 2, kernel_size=3, stride=1, padding=1, bias=use_bias),
                norm_layer(ngf * mult * 2),
                nn.ReLU(True),
                Downsample(ngf * mult * 2),
            ]
        model += [ResnetBlock(ngf * 4, norm_layer, use_dropout, use_bias) for _ in range(n_blocks)]
        for i in range(2):  # upsampling, anti-aliased
            mult = 2 ** (2 - i)
            model += [
                Upsample(ngf * mult),
                nn.Conv2d(ngf * mult, int(ngf * mult / 2), kernel_size=3, stride=1, padding=1, bias=use_bias),
                norm_layer(int(ngf * mult / 2)),
                nn.ReLU(True),
            ]
        model += [nn.ReflectionPad2d(3), nn.Conv2d(ngf, output_nc, kernel_size=7, padding=0), nn.Tanh()]
        self.model = nn.Sequential(*model)

    def forward(self, input: Tensor, layers: Sequence[int] = (), encode_only: bool = False) -> Any:  # noqa: A002
        if len(layers) > 0:
            feat = input
            feats = []
            for layer_id, layer in enumerate(self.model):
                feat = layer(feat)
                if layer_id in layers:
                    feats.append(feat)
                if layer_id == layers[-1] and encode_only:
                    return feats  # return intermediate features alone; stop in the last layers
            return feat, feats  # return both output and intermediate features
        return self.model(input)


# --------------------------------------------------------------------------------------------------
# the benchmark


def nce_paths(layers: Sequence[int] = NCE_LAYERS) -> list[str]:
    """CUT's layer indices as module paths of the generator."""
    return [f"model.{i}" for i in layers]


def feature_loss(feats: Sequence[Tensor]) -> Tensor:
    """A loss on every feature (the PatchNCE loss's MLP heads and patch sampling left out: the same for all)."""
    return torch.stack([f.square().mean() for f in feats]).sum()


def run(cfg: H.Settings, batch: int, size: int, ngf: int, n_blocks: int) -> R.Group:
    torch.manual_seed(H.SEED)
    floor = ResnetGenerator(ngf=ngf, n_blocks=n_blocks).to(cfg.device).train()
    ours, watched = copy.deepcopy(floor), copy.deepcopy(floor)  # capture's hooks must not slow the others down
    x = torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(H.SEED)).to(cfg.device) * 2 - 1
    paths = nce_paths()

    def step(model: nn.Module, feats: Sequence[Tensor]) -> list[Tensor]:
        model.zero_grad(set_to_none=True)
        feature_loss(feats).backward()
        return list(feats)

    with fh.capture(watched, paths) as captured:

        def full() -> list[Tensor]:
            watched(x)
            return step(watched, list(captured.values()))

        contenders: dict[str, Callable[[], Any]] = {
            CUT: lambda: step(floor, floor(x, NCE_LAYERS, encode_only=True)),
            OURS: lambda: step(ours, list(intermediates(ours, x, paths).values())),
            CAPTURE: full,
        }
        reference = contenders[CUT]()
        extras = {name: {"max_abs_diff": H.max_abs_diff(fn(), reference)} for name, fn in contenders.items()}
        timing = H.time_interleaved(contenders, cfg)
    params = {"mode": "train, grad", "batch": batch, "size": size, "ngf": ngf, "n_blocks": n_blocks}
    return R.make_group(f"CUT ResnetGenerator, nce_layers {NCE_LAYERS}", params, timing, CUT, extras)


def targets(groups: list[R.Group]) -> list[R.Target]:
    """intermediates at least ``SPEED`` times as fast as CUT's own encode_only forward, in every group."""
    return [R.Target(f"{CUT} / {OURS} (speed)", g.label, R.ratio(g, CUT, OURS), SPEED, ">=") for g in groups]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = H.parser(__doc__.splitlines()[0])
    SHAPES.add_option(p)
    p.add_argument("--ngf", type=int, default=None, help="generator width (CUT: 64); default 4 with --quick, else 16")
    p.add_argument("--n-blocks", type=int, default=None, help="ResNet blocks (CUT: 9); default 5 with --quick")
    args = p.parse_args(argv)
    cfg = H.settings(args, budget=20.0)
    ngf = args.ngf or (4 if cfg.quick else 64 if cfg.cuda else 16)
    n_blocks = args.n_blocks or (5 if cfg.quick else 9)
    groups = []
    for batch, size in SHAPES.parse(args.shapes, cfg):
        group = run(cfg, batch, size, ngf, n_blocks)
        H.log(f"{batch}x{size}: " + ", ".join(f"{row.name}={row.median_ms:.2f}ms" for row in group.rows))
        groups.append(group)
    notes = [
        "Forward and backward of a loss on the features, generator in train mode; *ratio* > 1: slower than CUT's own "
        "forward. *max abs diff*: the features against CUT's (0: bitwise the same).",
    ]
    payload = R.save(
        "live_exit",
        "Early exit on a live module: CUT's PatchNCE features",
        cfg,
        groups,
        targets(groups),
        {**cfg.timing_config(), "ngf": ngf, "n_blocks": n_blocks},
        notes,
        extra_columns=[R.ABS_DIFF_COLUMN],
    )
    return R.publish(cfg, payload)


if __name__ == "__main__":
    main()
