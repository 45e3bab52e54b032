"""ImageNet-style training augmentation with Pillow, numpy and torch (no torchvision needed).

Three paths give the same distribution of crops:

- `train_transform(data)`: decode the whole JPEG, then RandomResizedCrop(224) and a random
  horizontal flip, as torchvision's `RandomResizedCrop(224)` + `RandomHorizontalFlip()` do
  (bilinear, antialiased resize), into a uint8 CHW tensor.
- `fast_train_transform(data)`: the same crop box, drawn from the image's size (read from the
  JPEG header, before decoding), then JPEG *draft mode*: libjpeg decodes at the smallest DCT
  scale (1/2, 1/4, 1/8) that still leaves the crop at least 224 pixels on each side, so a crop
  of a large image costs a fraction of a full decode. This is the CPU counterpart of DALI's
  region-of-interest decode. The crop is resized by torch's antialiased bilinear kernel for
  uint8 (the one torchvision's tensor transforms use, built to match Pillow's, and cheaper),
  flipped, and made CHW in one copy. Pixels differ slightly from the full decode (the
  downscale happens in the DCT domain, and the crop is widened to whole decoded pixels); the
  crops' positions, sizes and flips are drawn identically.
- `turbo_train_transform(data)`: the draft path through simplejpeg (an optional package:
  libjpeg-turbo scaled on decode), decoded straight into a 4-byte-per-pixel array that the
  resize reads in place. It keeps libjpeg-turbo's accurate IDCT and smooth chroma
  upsampling: the fast ones (`fastdct=True, fastupsample=True`, what tf.data's
  `dct_method="INTEGER_FAST"` selects) change pixel values slightly and saved no measurable
  time on the benchmark's images (within 5%, the run-to-run noise).

Randomness comes from torch's global generator, as torchvision's does, so DataLoader worker
seeding (and `tds.DataLoader`'s per-batch seeds) applies. Copy this file into your project.
"""

from __future__ import annotations

import io
import math

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

SIZE = 224
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)


def crop_box(width: int, height: int, scale: tuple[float, float] = SCALE,
             ratio: tuple[float, float] = RATIO) -> tuple[int, int, int, int]:
    """torchvision's `RandomResizedCrop.get_params`: (left, top, crop width, crop height)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,)).item())
            left = int(torch.randint(0, width - w + 1, size=(1,)).item())
            return left, top, w, h
    # Fallback: a central crop with the aspect ratio clamped into range.
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def _chw(image: Image.Image) -> torch.Tensor:
    """uint8 CHW. numpy's transposing copy: torch's permute().contiguous() costs several times
    more CPU on such small images (it wakes its intra-op threads)."""
    return torch.from_numpy(np.ascontiguousarray(np.asarray(image).transpose(2, 0, 1)))


def _finish(image: Image.Image, box: tuple[float, float, float, float]) -> torch.Tensor:
    """Resize `box` of `image` to SIZE x SIZE (bilinear, antialiased), flip with p=0.5, and
    return uint8 CHW."""
    out = image.resize((SIZE, SIZE), Image.BILINEAR, box=box)
    if torch.rand(1).item() < 0.5:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    return _chw(out)


def _finish_pixels(pixels: np.ndarray, box: tuple[float, float, float, float]) -> torch.Tensor:
    """`_finish` for decoded HWC uint8 pixels (RGB, or RGBX whose fourth byte is dropped): the
    box widened to whole pixels, resized by torch's antialiased bilinear uint8 kernel (read in
    place, channels last), flipped with p=0.5, and copied once into CHW."""
    left, top, right, bottom = box
    region = pixels[math.floor(top):math.ceil(bottom), math.floor(left):math.ceil(right)]
    image = torch.from_numpy(region).permute(2, 0, 1).unsqueeze(0)  # a view, no copy
    out = F.interpolate(image, size=(SIZE, SIZE), mode="bilinear", antialias=True,
                        align_corners=False)[0, :3]
    if torch.rand(1).item() < 0.5:
        out = out.flip(2)
    return out.contiguous()


def train_transform(data: bytes) -> torch.Tensor:
    """Full decode, then RandomResizedCrop(224) and a random flip: torchvision's recipe."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    left, top, w, h = crop_box(*image.size)
    return _finish(image, (left, top, left + w, top + h))


def fast_train_transform(data: bytes) -> torch.Tensor:
    """The same crop, decoded at the smallest JPEG scale that still covers it (draft mode)."""
    image = Image.open(io.BytesIO(data))
    width, height = image.size  # from the header: nothing decoded yet
    left, top, w, h = crop_box(width, height)
    if image.format == "JPEG":
        # Ask for a decode at least this large; libjpeg picks the smallest scale >= it.
        image.draft("RGB", (math.ceil(width * SIZE / w), math.ceil(height * SIZE / h)))
    pixels = np.array(image if image.mode == "RGB" else image.convert("RGB"))  # writable
    sx, sy = pixels.shape[1] / width, pixels.shape[0] / height
    return _finish_pixels(pixels, (left * sx, top * sy, (left + w) * sx, (top + h) * sy))


def turbo_train_transform(data: bytes) -> torch.Tensor:
    """The draft path through simplejpeg (`pip install simplejpeg`: libjpeg-turbo, scaled on
    decode), into RGBX the resize reads in place."""
    import simplejpeg

    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    left, top, w, h = crop_box(width, height)
    pixels = simplejpeg.decode_jpeg(
        data, "RGBX",
        min_height=math.ceil(height * SIZE / h), min_width=math.ceil(width * SIZE / w))
    sx, sy = pixels.shape[1] / width, pixels.shape[0] / height
    return _finish_pixels(pixels, (left * sx, top * sy, (left + w) * sx, (top + h) * sy))


def eval_transform(data: bytes, resize: int = 256) -> torch.Tensor:
    """Resize the short side to `resize` and take the central SIZE x SIZE crop (uint8 CHW)."""
    image = Image.open(io.BytesIO(data))
    if image.format == "JPEG":
        image.draft("RGB", (resize, resize))
    image = image.convert("RGB")
    scale = resize / min(image.size)
    image = image.resize((max(resize, round(image.size[0] * scale)),
                          max(resize, round(image.size[1] * scale))), Image.BILINEAR)
    left, top = (image.size[0] - SIZE) // 2, (image.size[1] - SIZE) // 2
    image = image.crop((left, top, left + SIZE, top + SIZE))
    return _chw(image)
