"""Issue 40's speed question: is ``evaluate`` faster than the separate calls, and each generative metric faster
than the reference implementation a user would otherwise run, with the same numbers?

Four groups, each contender the whole job as a user runs it, in this process: build the model from the cached
weights, read the two folders, compute the number (process start-up and imports left out). Every contender of a
group reads the same files and the same seeded weights, with the same batch size and decoding workers:

- *evaluate*: ``evaluate(real, fake, ["fid", "fd_dinov2", "kid", "prdc"])`` (each image decoded once, one pass of
  each backbone) against what a user writes today with the single-metric functions. *separate calls* (the
  baseline): ``fid_statistics`` of each set and ``frechet_distance`` (FID); ``fd_dinov2(real, fake)``; KID and PRDC
  from ``fid_statistics(..., keep=N)`` of each set, a second Inception pass (the recipe of ``docs/metrics.md``'s
  KID section, and what ``featurehooks fid`` then ``featurehooks fd --kid --prdc`` do). *separate calls, one
  Inception pass*: FID, KID and PRDC from one ``fid_statistics(..., keep=N)`` per set, and ``fd_dinov2``: the
  user who knows that one kept sample serves all three; evaluate's gain over it is decoding each image once.
- *IS*: ``inception_score(fake)`` against ``torch_fidelity.calculate_metrics(input1=fake, isc=True,
  feature_extractor_weights_path=...)``, on one weights file (the seeded FID Inception with ``fc`` scaled, so the
  score is well above 1).
- *CMMD*: ``cmmd(real, fake)`` against cmmd-pytorch's recipe, written here from its definitions: the largest
  centered square, Pillow bicubic to 336, ``float32 / 255``, torch bicubic to 336, ``CLIPImageProcessor``
  normalizing only, ``CLIPVisionModelWithProjection(...).image_embeds`` scaled to unit length, MMD in float32.
- *FD_DINOv2*: ``fd_dinov2(real, fake)`` against dgm-eval's recipe: ``Resize((224, 224), BICUBIC)`` of the PIL
  image, ``ToTensor``, ``Normalize`` (ImageNet), a timm DINOv2 ViT at 224 holding the hub checkpoint with its
  position embedding resized once by DINOv2's rule (the hub model resizes it on every forward: microseconds), the
  class token after the final norm, float64 numpy features, ``np.cov`` and scipy's ``sqrtm``.

The images: *real*, JPEGs (quality 90) of seeded random crops of scikit-image's photos at camera sizes (333 to
640 pixels a side, landscape and portrait), as ``dump_throughput.py`` makes them; *fake*, 256x256 PNG crops of the
same photos (a generator's output: one size, which torch-fidelity needs). Weights: seeded random files where each
library looks (``_weights.py``): the FID Inception, DINOv2 ViT-S/14 by default (``--dinov2-model vitl14``:
FD_DINOv2's own, ~15x the compute), and a CLIP image tower at CMMD's 336 pixels cached as
``openai/clip-vit-large-patch14-336``: by default ``base``, ViT-B/32's width, depth and token count (7x7 patches
of 48; ``--clip-model large`` is ViT-L/14@336, ~20x the compute).

After one profiled call of each contender (its numbers and its peak memory) and one warm-up call, the
contenders run in interleaved rounds; ratios are medians over the rounds. Each number of each contender is
compared with the group's featurehooks function's (``max rel diff``).

    python benchmarks/generative.py                 # 50 images a set, ~8 minutes on 2 cores
    python benchmarks/generative.py --images 200 --dinov2-model vitl14 --clip-model large   # the real backbones
    python benchmarks/generative.py --groups is,cmmd
    python benchmarks/generative.py --quick         # seconds: checks the script, not speed

Needs scikit-image (the photos), torch-fidelity, transformers, scipy. Writes ``benchmarks/results/generative.json``
(machine, versions, every sample) and ``.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from featurehooks.metrics import cmmd as fh_cmmd
from featurehooks.metrics import (
    evaluate,
    fd_dinov2,
    fid_statistics,
    frechet_distance,
    inception_score,
    kernel_inception_distance,
    precision_recall,
)

import _harness as H
import _report as R
from _machine import loadavg
from _weights import (
    CLIP_VISION,
    hub_cache_in_hf_home,
    seeded_clip_cache,
    seeded_dinov2_weights,
    seeded_fid_weights,
    seeded_isc_weights,
    seeded_torch_home,
)
from dump_throughput import SIZES, source_photos  # the script beside this one: photos, camera sizes

NAME = "generative"
TITLE = "Generative metrics: evaluate vs separate calls, and each metric vs its reference implementation"
GROUPS = ("evaluate", "is", "cmmd", "fd_dinov2")
CASES = {
    "evaluate": "evaluate(fid, fd_dinov2, kid, prdc) vs the separate calls",
    "is": "Inception Score vs torch-fidelity",
    "cmmd": "CMMD vs the cmmd-pytorch recipe",
    "fd_dinov2": "FD_DINOv2 vs the dgm-eval recipe",
}
EVALUATE = "featurehooks evaluate"
SEPARATE = "separate calls (FID; FD_DINOv2; KID + PRDC from a second Inception pass)"
SHARED = "separate calls, one Inception pass (fid_statistics keep=N: FID, KID, PRDC; FD_DINOv2)"
FH_IS = "featurehooks inception_score"
TF_IS = "torch_fidelity.calculate_metrics(isc=True)"
FH_CMMD = "featurehooks cmmd"
REF_CMMD = "cmmd-pytorch recipe"
FH_FD = "featurehooks fd_dinov2"
REF_FD = "dgm-eval recipe"
FAKE_SIDE = 256
JPEG_QUALITY = 90
EVALUATE_SPEEDUP = 1.5  # issue 40: evaluate against the separate calls
AGREE = 1e-6  # evaluate's numbers against the single-metric functions': the same arithmetic
AGREE_IS = 1e-5  # inception_score against torch-fidelity (tests/metrics/test_inception_score.py's bound)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)

Numbers = dict[str, float]


# --------------------------------------------------------------------------------------------------
# the images


def write_sets(root: Path, count: int, seed: int = H.SEED) -> tuple[Path, Path]:
    """Two flat folders of ``count`` images each (the references list a folder's own files): ``real/``, JPEGs of
    random crops of the photos at camera sizes, and ``fake/``, 256x256 PNG crops."""
    rng = np.random.default_rng(seed)
    photos = source_photos()
    names = sorted(photos)
    real, fake = root / "real", root / "fake"
    for folder in (real, fake):
        folder.mkdir(parents=True)
    for i in range(2 * count):
        name = names[i % len(names)]
        photo = Image.fromarray(photos[name])
        width, height = SIZES[rng.integers(len(SIZES))] if i < count else (FAKE_SIDE, FAKE_SIDE)
        scale = min(photo.width / width, photo.height / height) * rng.uniform(0.55, 1.0)
        crop_w, crop_h = max(1, round(width * scale)), max(1, round(height * scale))
        left = int(rng.integers(0, photo.width - crop_w + 1))
        top = int(rng.integers(0, photo.height - crop_h + 1))
        picture = photo.crop((left, top, left + crop_w, top + crop_h)).resize((width, height), Image.Resampling.BICUBIC)
        if rng.random() < 0.5:
            picture = picture.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        if i < count:
            picture.save(real / f"{name}_{i:04d}.jpg", quality=JPEG_QUALITY)
        else:
            picture.save(fake / f"{name}_{i - count:04d}.png")
    return real, fake


def list_files(folder: Path, suffixes: Sequence[str]) -> list[str]:
    """A folder's own files with these suffixes (either case), sorted: how the reference scripts list a folder."""
    found = {
        path for suffix in suffixes for case in (suffix, suffix.upper()) for path in glob.glob(f"{folder}/*.{case}")
    }
    return sorted(found)


# --------------------------------------------------------------------------------------------------
# the settings of one run


@dataclasses.dataclass(frozen=True)
class Job:
    """What every contender gets: the two folders, the batch size and decoding workers, the metrics' parameters."""

    real: Path
    fake: Path
    count: int
    batch: int
    workers: int
    dinov2_model: str
    kid_subset_size: int
    prdc_k: int
    is_splits: int
    device: torch.device

    @property
    def options(self) -> dict[str, Any]:
        """featurehooks' stream options."""
        return {"batch_size": self.batch, "num_workers": self.workers}


def _flat(numbers: dict[str, Any]) -> Numbers:
    """evaluate's numbers as floats by name: ``kid`` to ``kid_mean``/``kid_std``, ``prdc`` to its four fields."""
    flat: Numbers = {}
    for name, value in numbers.items():
        if name == "kid":
            flat["kid_mean"], flat["kid_std"] = (float(v) for v in value)
        elif name == "prdc":
            flat.update({field: float(v) for field, v in value._asdict().items()})
        else:
            flat[name] = float(value)
    return flat


# --------------------------------------------------------------------------------------------------
# group 1: evaluate against the separate calls


def evaluate_contenders(job: Job) -> dict[str, Callable[[], Numbers]]:
    """evaluate, the separate calls of today, and the separate calls sharing one Inception pass per set."""
    real, fake, options, device = str(job.real), str(job.fake), job.options, job.device

    def kid_prdc(a: Any, b: Any) -> dict[str, Any]:
        return {
            "kid": kernel_inception_distance(a, b, subset_size=job.kid_subset_size),
            "prdc": precision_recall(a, b, k=job.prdc_k),
        }

    def one_pass() -> Numbers:
        found = evaluate(
            real,
            fake,
            ["fid", "fd_dinov2", "kid", "prdc"],
            dinov2_model=job.dinov2_model,
            device=device,
            kid_subset_size=job.kid_subset_size,
            prdc_k=job.prdc_k,
            **options,
        )
        return _flat(found.numbers)

    def separate() -> Numbers:
        fid = frechet_distance(*(fid_statistics(s, device=device, **options) for s in (real, fake)))
        fd = fd_dinov2(real, fake, model=job.dinov2_model, device=device, **options)
        a, b = (fid_statistics(s, device=device, keep=job.count, **options) for s in (real, fake))
        return _flat({"fid": fid, "fd_dinov2": fd, **kid_prdc(a, b)})

    def shared() -> Numbers:
        a, b = (fid_statistics(s, device=device, keep=job.count, **options) for s in (real, fake))
        fd = fd_dinov2(real, fake, model=job.dinov2_model, device=device, **options)
        return _flat({"fid": frechet_distance(a, b), "fd_dinov2": fd, **kid_prdc(a, b)})

    return {SEPARATE: separate, SHARED: shared, EVALUATE: one_pass}


# --------------------------------------------------------------------------------------------------
# group 2: the Inception Score against torch-fidelity


def is_contenders(job: Job, weights: Path) -> dict[str, Callable[[], Numbers]]:
    """featurehooks' inception_score and torch-fidelity's isc of the fake set, on one weights file."""
    import torch_fidelity

    def ours() -> Numbers:
        mean, std = inception_score(
            str(job.fake), weights=weights, splits=job.is_splits, device=job.device, **job.options
        )
        return {"is_mean": mean, "is_std": std}

    def theirs() -> Numbers:
        found = torch_fidelity.calculate_metrics(
            input1=str(job.fake),
            isc=True,
            isc_splits=job.is_splits,
            feature_extractor_weights_path=str(weights),
            cuda=job.device.type == "cuda",
            batch_size=job.batch,
            save_cpu_ram=job.workers == 0,  # 0 workers; else its own min(4, 2 x CPUs)
            cache=False,
            verbose=False,
        )
        return {"is_mean": float(found["inception_score_mean"]), "is_std": float(found["inception_score_std"])}

    return {TF_IS: theirs, FH_IS: ours}


# --------------------------------------------------------------------------------------------------
# group 3: CMMD against cmmd-pytorch's recipe


class CMMDImages(torch.utils.data.Dataset):
    """cmmd-pytorch's dataset: the largest centered square, Pillow bicubic to ``size``, float32 pixels, RGB."""

    def __init__(self, folder: Path, size: int) -> None:
        self.files, self.size = list_files(folder, ("png", "jpg", "jpeg")), size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> np.ndarray:
        image = Image.open(self.files[index])
        width, height = image.size
        side = min(width, height)
        top, left = (height - side) // 2, (width - side) // 2
        square = image.crop((left, top, left + side, top + side)).resize(
            (self.size, self.size), Image.Resampling.BICUBIC
        )
        pixels = np.asarray(square).astype(np.float32)
        return pixels if pixels.ndim == 3 else np.tile(pixels[..., None], (1, 1, 3))


def cmmd_recipe(job: Job, snapshot: Path) -> Numbers:
    """cmmd-pytorch's ``compute_cmmd`` of the two folders: its embedding model, data and float32 MMD."""
    from transformers import CLIPImageProcessor, CLIPVisionModelWithProjection

    with quiet_transformers():  # its load report lists the text tower's keys, which the image model leaves out
        model = CLIPVisionModelWithProjection.from_pretrained(str(snapshot)).eval().to(job.device)
    size = model.config.image_size
    processor = CLIPImageProcessor(crop_size={"height": size, "width": size})

    @torch.no_grad()
    def embed(images: np.ndarray) -> torch.Tensor:
        floats = torch.from_numpy(images.transpose(0, 3, 1, 2))
        resized = torch.nn.functional.interpolate(floats, size=(size, size), mode="bicubic").permute(0, 2, 3, 1)
        only_normalize = {"do_normalize": True, "do_center_crop": False, "do_resize": False, "do_rescale": False}
        inputs = processor(images=resized.numpy(), return_tensors="pt", **only_normalize)
        embeds = model(**{k: v.to(job.device) for k, v in inputs.items()}).image_embeds.cpu()
        return embeds / torch.linalg.norm(embeds, axis=-1, keepdims=True)

    def embeddings(folder: Path) -> np.ndarray:
        loader = torch.utils.data.DataLoader(CMMDImages(folder, size), batch_size=job.batch, num_workers=job.workers)
        return np.concatenate([np.asarray(embed(batch.numpy() / 255.0)) for batch in loader]).astype("float32")

    x, y = torch.from_numpy(embeddings(job.real)), torch.from_numpy(embeddings(job.fake))
    # the recipe's float32 MMD, and the same arithmetic in float64 (microseconds): what float32 costs
    return {"cmmd": mmd(x, y), "cmmd_float64_mmd": mmd(x.double(), y.double())}


def mmd(x: torch.Tensor, y: torch.Tensor) -> float:
    """cmmd-pytorch's ``distance.mmd``: 1000 x the biased MMD² with a Gaussian RBF kernel of sigma 10."""
    gamma = 1 / (2 * 10**2)

    def mean_kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a_norms, b_norms = torch.diag(a @ a.T), torch.diag(b @ b.T)
        return torch.mean(torch.exp(-gamma * (-2 * (a @ b.T) + a_norms[:, None] + b_norms[None, :])))

    return float(1000 * (mean_kernel(x, x) + mean_kernel(y, y) - 2 * mean_kernel(x, y)))


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' logging at errors only and no progress bars, within the block."""
    from transformers.utils import logging

    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def cmmd_contenders(job: Job, snapshot: Path) -> dict[str, Callable[[], Numbers]]:
    """featurehooks' cmmd and cmmd-pytorch's recipe, on one cached CLIP tower."""
    return {
        REF_CMMD: lambda: cmmd_recipe(job, snapshot),
        FH_CMMD: lambda: {"cmmd": fh_cmmd(str(job.real), str(job.fake), device=job.device, **job.options)},
    }


# --------------------------------------------------------------------------------------------------
# group 4: FD_DINOv2 against dgm-eval's recipe


def dinov2_pos_embed(pos_embed: torch.Tensor, grid: int) -> torch.Tensor:
    """DINOv2's ``interpolate_pos_encoding`` for a square ``grid``: bicubic, no antialiasing, scale ``(grid + 0.1) /
    trained grid`` (its hub entries' ``interpolate_offset``)."""
    dim, trained = pos_embed.shape[-1], math.isqrt(pos_embed.shape[1] - 1)
    patches = pos_embed[:, 1:].float().reshape(1, trained, trained, dim).permute(0, 3, 1, 2)
    scale = (grid + 0.1) / trained
    patches = torch.nn.functional.interpolate(patches, scale_factor=(scale, scale), mode="bicubic", antialias=False)
    return torch.cat((pos_embed[:, :1], patches.permute(0, 2, 3, 1).reshape(1, grid * grid, dim)), dim=1)


def dgm_eval_model(model: str, weights: Path) -> torch.nn.Module:
    """The hub entry ``dinov2_<model>`` as a timm ViT at 224 whose output is ``x_norm_clstoken``."""
    import re

    import timm

    from featurehooks.backbones.dinov2 import DINOV2_MODELS

    network = timm.create_model(DINOV2_MODELS[f"dinov2_{model}"], pretrained=False, img_size=224, num_classes=0)
    hub = torch.load(weights, map_location="cpu", weights_only=True)
    state = {re.sub(r"mlp\.w12\.", "mlp.fc1.", re.sub(r"mlp\.w3\.", "mlp.fc2.", k)): v for k, v in hub.items()}
    state.pop("mask_token")
    state["pos_embed"] = dinov2_pos_embed(state["pos_embed"], 224 // 14)
    network.load_state_dict(state)
    return network.eval()


class DGMImages(torch.utils.data.Dataset):
    """dgm-eval's ``ImagePathDataset`` with ``DINOv2Encoder.transform``."""

    def __init__(self, folder: Path) -> None:
        import torchvision.transforms as T

        self.files = list_files(folder, ("bmp", "jpg", "jpeg", "pgm", "png", "ppm", "tif", "tiff", "webp"))
        self.transform = T.Compose(
            [
                T.Resize((224, 224), T.InterpolationMode.BICUBIC),
                T.ToTensor(),
                T.Normalize(np.array(IMAGENET_MEAN), np.array(IMAGENET_STD)),
            ]
        )

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.transform(Image.open(self.files[index]).convert("RGB"))  # type: ignore[no-any-return]


def frechet_numpy(a: np.ndarray, b: np.ndarray, eps: float = 1e-6) -> float:
    """dgm-eval's ``compute_FD_with_reps``: ``np.mean``/``np.cov`` and scipy's ``sqrtm`` of the product."""
    from scipy import linalg

    mu1, mu2 = np.mean(a, axis=0), np.mean(b, axis=0)
    sigma1, sigma2 = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean, _ = linalg.sqrtm(sigma1.dot(sigma2), disp=False)
    if not np.isfinite(covmean).all():
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = linalg.sqrtm((sigma1 + offset).dot(sigma2 + offset))
    covmean = covmean.real
    diff = mu1 - mu2
    return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


def dgm_eval_fd(job: Job, weights: Path) -> float:
    """dgm-eval's ``fd`` of the two folders: its DINOv2 encoder, data loader, float64 features and Fréchet distance."""
    network = dgm_eval_model(job.dinov2_model, weights).to(job.device)

    def representations(folder: Path) -> np.ndarray:
        images = DGMImages(folder)
        loader = torch.utils.data.DataLoader(images, batch_size=job.batch, num_workers=job.workers)
        width: int = network.num_features  # type: ignore[assignment]
        found, start = np.empty((len(images), width)), 0
        for batch in loader:
            with torch.no_grad():
                found[start : start + batch.shape[0]] = network(batch.to(job.device)).cpu().numpy()
            start += batch.shape[0]
        return found

    return frechet_numpy(representations(job.real), representations(job.fake))


def fd_contenders(job: Job, weights: Path) -> dict[str, Callable[[], Numbers]]:
    """featurehooks' fd_dinov2 and dgm-eval's recipe, on one hub checkpoint."""
    return {
        REF_FD: lambda: {"fd_dinov2": dgm_eval_fd(job, weights)},
        FH_FD: lambda: {
            "fd_dinov2": fd_dinov2(
                str(job.real), str(job.fake), model=job.dinov2_model, device=job.device, **job.options
            )
        },
    }


# --------------------------------------------------------------------------------------------------
# timing one group


MEASURED_AGAINST = {"is_std": "is_mean"}  # a number whose difference is measured against another number's size


def relative_differences(found: Numbers, reference: Numbers) -> Numbers:
    """``|found - reference| / |reference|`` per number of ``found``; a number named after one of ``reference``'s
    (``cmmd_float64_mmd`` after ``cmmd``) is compared with that one. The IS std is divided by ``|is_mean|`` instead
    (``MEASURED_AGAINST``): the spread of a few split scores is their difference, so its error is the scores' own (at
    two images a split, float32 rounding read 1.2e-4 of the std itself against torch-fidelity on an AVX-512 EPYC)."""
    differences = {}
    for name, value in found.items():
        base = next(key for key in reference if name.startswith(key))
        difference = abs(value - reference[base])
        scale = reference.get(MEASURED_AGAINST.get(base, base), reference[base])
        differences[name] = difference / abs(scale) if scale else difference
    return differences


def run_group(
    group: str, contenders: dict[str, Callable[[], Numbers]], ours: str, per_set: int, sets: int, cfg: H.Settings
) -> tuple[R.Group, dict[str, Numbers]]:
    """One profiled call of each contender (its numbers and peak memory, and its warm-up), then interleaved timed
    rounds (in quick mode the profiled call is the one timing); returns the group, and each contender's differences
    from ``ours``."""
    numbers: dict[str, Numbers] = {}
    peaks: dict[str, float] = {}
    once: dict[str, list[float]] = {}
    for name, fn in contenders.items():
        H.log(f"{group}: {name}")
        H.release_memory()

        def call(fn: Callable[[], Numbers] = fn, name: str = name) -> None:
            numbers[name] = fn()

        start = time.perf_counter()
        peaks[name] = H.peak_memory(call, cfg.device) / 2**20
        once[name] = [time.perf_counter() - start]
    if cfg.quick:
        timing = H.Timing(once, 1, 1)
    else:
        timing = H.time_interleaved({name: WarmedUp(fn) for name, fn in contenders.items()}, cfg)
    differences = {name: relative_differences(found, numbers[ours]) for name, found in numbers.items()}
    during = loadavg()
    extras = {
        name: {
            "images_per_s": per_set * sets / timing.median(name),
            "peak_mib": peaks[name],
            "max_rel_diff": max(v for k, v in differences[name].items() if k in numbers[ours]),
            "numbers": numbers[name],
            "load_average": during,
            **(numbers[name] if group != "evaluate" else {}),  # one or two numbers: their own columns
        }
        for name in contenders
    }
    baseline = next(iter(contenders))
    params = {"images": "+".join([str(per_set)] * sets)}
    made = R.make_group(CASES[group], params, timing, baseline, extras)
    H.log(f"{CASES[group]}: " + ", ".join(f"{r.name}={r.ratio:.3f} ({r.extra['peak_mib']:.0f} MiB)" for r in made.rows))
    return made, differences


class WarmedUp:
    """A contender whose first call returns at once: the profiled call was its warm-up, so the harness's own warm-up
    call (it makes at least one) costs nothing; ``--warmup 2`` and more add real ones."""

    def __init__(self, fn: Callable[[], Numbers]) -> None:
        self.fn, self.warm = fn, False

    def __call__(self) -> Numbers | None:
        if not self.warm:
            self.warm = True
            return None
        return self.fn()


# --------------------------------------------------------------------------------------------------
# report


def targets(groups: list[R.Group]) -> list[R.Target]:
    found = []
    for g in groups:
        label = R.format_params(g.params)
        if g.case == CASES["evaluate"]:
            found += [
                R.Target(
                    "separate calls time / evaluate time", label, R.ratio(g, SEPARATE, EVALUATE), EVALUATE_SPEEDUP, ">="
                ),
                R.Target(
                    "one-Inception-pass calls time / evaluate time", label, R.ratio(g, SHARED, EVALUATE), 1.0, ">="
                ),
                R.Target(
                    "evaluate's numbers: max rel diff from the separate calls'",
                    label,
                    max(g.row(SEPARATE).extra["max_rel_diff"], g.row(SHARED).extra["max_rel_diff"]),
                    AGREE,
                    "<=",
                    "",
                ),
            ]
        pairs = {CASES["is"]: (FH_IS, TF_IS), CASES["cmmd"]: (FH_CMMD, REF_CMMD), CASES["fd_dinov2"]: (FH_FD, REF_FD)}
        if g.case in pairs:
            ours, reference = pairs[g.case]
            found.append(R.Target(f"{reference} time / {ours} time", label, R.ratio(g, reference, ours), 1.0, ">="))
            peak = g.row(ours).extra["peak_mib"] / max(g.row(reference).extra["peak_mib"], 1e-9)
            found.append(R.Target(f"{ours} peak / {reference} peak", label, peak, 1.0, "<="))
            if g.case == CASES["is"]:
                diff = g.row(reference).extra["max_rel_diff"]
                found.append(
                    R.Target("inception_score: max rel diff from torch-fidelity", label, diff, AGREE_IS, "<=", "")
                )
    return found


def agreement_notes(differences: dict[str, dict[str, Numbers]]) -> list[str]:
    """One line per group: each number's largest relative difference between a contender and featurehooks'."""
    lines = []
    for group, by_contender in differences.items():
        worst: Numbers = {}
        for values in by_contender.values():
            for number, value in values.items():
                worst[number] = max(worst.get(number, 0.0), value)
        text = ", ".join(f"{number} {value:.1e}" for number, value in worst.items())
        lines.append(f"{CASES[group]}: largest relative difference of each number from featurehooks': {text}.")
    return lines


# --------------------------------------------------------------------------------------------------
# main


def job_defaults(args: Any, cfg: H.Settings) -> Job:
    count = args.images or (4 if cfg.quick else 50)
    workers = args.workers if args.workers is not None else 0 if cfg.quick else min(2, os.cpu_count() or 1)
    return Job(
        real=Path(),
        fake=Path(),
        count=count,
        batch=args.batch_size or (2 if cfg.quick else 25),
        workers=workers,
        dinov2_model=args.dinov2_model,
        kid_subset_size=max(2, count // 2),
        prdc_k=min(5, count - 1),
        is_splits=min(10, max(1, count // 2)),  # at least two images a split: one alone scores 1
        device=cfg.device,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = H.parser(__doc__.splitlines()[0])
    p.add_argument("--groups", default=",".join(GROUPS), help=f"subset of {', '.join(GROUPS)}")
    p.add_argument("--images", type=int, default=None, help="images per set (default: 50; 4 with --quick)")
    p.add_argument("--batch-size", type=int, default=None, help="images per batch, every contender (default: 25)")
    p.add_argument("--workers", type=int, default=None, help="decoding workers, every contender (default: 2)")
    p.add_argument("--dinov2-model", default="vits14", help="vits14 (default), vitb14, vitl14 (FD_DINOv2's), vitg14")
    p.add_argument("--clip-model", default=None, choices=sorted(CLIP_VISION), help="default: base (tiny if --quick)")
    args = p.parse_args(argv)
    cfg = H.settings(args, budget=0.0)
    if cfg.quick:  # one call of each contender: the profiled one
        cfg = dataclasses.replace(cfg, min_reps=1, max_reps=1, warmup=0)
    else:  # the whole jobs are long: three rounds after the warm-up (the profiled call) unless asked otherwise
        pick = {k: getattr(args, k) if getattr(args, k) is not None else 3 for k in ("min_reps", "max_reps")}
        warmup = 1 if args.warmup is None else args.warmup
        cfg = dataclasses.replace(cfg, min_reps=pick["min_reps"], max_reps=pick["max_reps"], warmup=warmup)
    groups = args.groups.split(",")
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise SystemExit(f"--groups takes {', '.join(GROUPS)}, not {', '.join(sorted(unknown))}")
    clip_model = args.clip_model or ("tiny" if cfg.quick else "base")
    job = job_defaults(args, cfg)
    differences: dict[str, dict[str, Numbers]] = {}  # by group: each contender's, for the notes
    notes = [
        "ratio = median / median of the group's first row (lower is faster). Each call is the whole job: the model "
        "built from the cached seeded weights, both folders read and decoded, the number computed (no process "
        f"start-up or imports). Every contender: batch {job.batch}, {job.workers} decoding worker(s) "
        "(torch-fidelity: none with 0, else its own min(4, 2 x CPUs)).",
        f"Backbones: FID Inception (299, legacy_pytorch for evaluate, legacy_tensorflow for IS); DINOv2 "
        f"{job.dinov2_model} at 224{' (FD_DINOv2 is vitl14)' if job.dinov2_model != 'vitl14' else ''}; CLIP "
        f"image tower '{clip_model}' at 336 ({CLIP_VISION[clip_model]['num_hidden_layers']} layers of width "
        f"{CLIP_VISION[clip_model]['hidden_size']}, patches of {CLIP_VISION[clip_model]['patch_size']}; CMMD's is "
        "'large', ViT-L/14@336).",
        f"Images: *real* {job.count} JPEGs at camera sizes (333-640 px), *fake* {job.count} PNGs of "
        f"{FAKE_SIDE}x{FAKE_SIDE}; IS scores *fake*. KID subsets of {job.kid_subset_size}, PRDC k={job.prdc_k}, IS "
        f"{job.is_splits} splits. Sets this small (below the dimensions) make FID singular: the numbers check "
        "agreement, they are no benchmark of image quality.",
        "peak MiB: memory allocated during one call above what was allocated before it "
        + (
            "(CUDA caching allocator peak)"
            if cfg.cuda
            else "(CPU: the profiler's allocation events of this process; decoding workers' memory is not in it)"
        )
        + ". max rel diff: the largest relative difference of the row's numbers from featurehooks' own in the group "
        "(evaluate's in the first group).",
        f"load average: the 1/5/15-minute load average at the end of the group (load average at the start: "
        f"{loadavg()}).",
    ]
    config = {
        "groups": groups,
        "images": job.count,
        "batch_size": job.batch,
        "workers": job.workers,
        "dinov2_model": job.dinov2_model,
        "clip_model": clip_model,
        "clip_vision": CLIP_VISION[clip_model],
        "kid_subset_size": job.kid_subset_size,
        "prdc_k": job.prdc_k,
        "is_splits": job.is_splits,
        "load_average_at_start": loadavg(),
        "versions": library_versions(),
        **cfg.timing_config(),
    }
    results = R.Results(
        NAME,
        TITLE,
        cfg,
        config,
        targets,
        notes,
        [
            ("images_per_s", "images/s", ".1f"),
            ("peak_mib", "peak MiB", ".0f"),
            ("max_rel_diff", "max rel diff", ".1e"),
            ("is_mean", "IS", ".5g"),
            ("cmmd", "CMMD", ".5g"),
            ("fd_dinov2", "FD_DINOv2", ".5g"),
        ],
        overview=lambda _: agreement_notes(differences),
    )
    with (
        warnings.catch_warnings(record=True) as caught,
        seeded_torch_home(args.torch_home) as home,
        hub_cache_in_hf_home(),
    ):
        warnings.simplefilter("always")
        with tempfile.TemporaryDirectory(prefix="fh_generative_", dir=home) as root:
            real, fake = write_sets(Path(root), job.count)
            job = dataclasses.replace(job, real=real, fake=fake)
            seeded_fid_weights()
            for group, (made, found) in run_groups(groups, job, clip_model, cfg):
                differences[group] = found
                results.add(made)
        seen = sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0][:160]}" for w in caught})
        for line in seen:
            H.log(f"warned: {line}")
        config["warnings"] = seen
    return results.finish()


def run_groups(
    groups: Sequence[str], job: Job, clip_model: str, cfg: H.Settings
) -> Iterator[tuple[str, tuple[R.Group, dict[str, Numbers]]]]:
    """Each asked group's result, in the order of ``GROUPS``, its weights written first."""
    if "evaluate" in groups:
        seeded_dinov2_weights(f"dinov2_{job.dinov2_model}")
        yield "evaluate", run_group("evaluate", evaluate_contenders(job), EVALUATE, job.count, 2, cfg)
    if "is" in groups:
        yield "is", run_group("is", is_contenders(job, seeded_isc_weights()), FH_IS, job.count, 1, cfg)
    if "cmmd" in groups:
        yield "cmmd", run_group("cmmd", cmmd_contenders(job, seeded_clip_cache(clip_model)), FH_CMMD, job.count, 2, cfg)
    if "fd_dinov2" in groups:
        weights = seeded_dinov2_weights(f"dinov2_{job.dinov2_model}")
        yield "fd_dinov2", run_group("fd_dinov2", fd_contenders(job, weights), FH_FD, job.count, 2, cfg)


def library_versions() -> dict[str, str | None]:
    """The versions of the references' libraries (the machine line names torch's and timm's)."""
    from importlib import metadata

    found: dict[str, str | None] = {}
    for name in ("torch-fidelity", "transformers", "scipy", "scikit-image", "Pillow"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


if __name__ == "__main__":
    main()
