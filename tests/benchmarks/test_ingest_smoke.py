"""benchmarks/ingest.py and examples/image_ops.py: the augmentation paths draw the same crops,
and the benchmark runs a tiny case end to end and prints its table."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))

import image_ops  # noqa: E402


def jpeg(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height // 32, width // 32, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(base).resize((width, height), Image.BICUBIC).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def test_crops_stay_in_torchvisions_ranges() -> None:
    torch.manual_seed(0)
    for _ in range(500):
        left, top, w, h = image_ops.crop_box(640, 480)
        assert 0 <= left and left + w <= 640 and 0 <= top and top + h <= 480
        assert 0.08 * 0.99 <= w * h / (640 * 480) <= 1.0
        assert 3 / 4 * 0.97 <= w / h <= 4 / 3 * 1.03


def test_the_draft_path_draws_the_same_crop_as_the_full_decode() -> None:
    # A large image: most crops let draft mode decode at 1/2 to 1/8 scale.
    data = jpeg(1600, 1200)
    for seed in range(8):
        torch.manual_seed(seed)
        full = image_ops.train_transform(data)
        torch.manual_seed(seed)
        fast = image_ops.fast_train_transform(data)
        assert full.shape == fast.shape == (3, 224, 224) and fast.dtype == torch.uint8
        # Same box and flip: pixels agree up to the DCT-domain downscale.
        assert (full.float() - fast.float()).abs().mean() < 6, seed


@pytest.mark.parametrize("size", [(1600, 1000), (1000, 1600), (480, 320)])
def test_the_simplejpeg_path_draws_the_same_crop_as_the_full_decode(size) -> None:
    """Landscape and portrait (its header gives height first), at 1/2..1/8 scale and at
    full scale."""
    data = jpeg(*size)
    for seed in range(8):
        torch.manual_seed(seed)
        full = image_ops.train_transform(data)
        torch.manual_seed(seed)
        turbo = image_ops.turbo_train_transform(data)
        assert turbo.shape == (3, 224, 224) and turbo.dtype == torch.uint8
        assert turbo.is_contiguous()
        assert (full.float() - turbo.float()).abs().mean() < 6, seed


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ingest_runs_a_case_and_prints_its_table(tmp_path: Path) -> None:
    out = tmp_path / "ingest.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "ingest.py"), "--images", "128",
         "--epochs", "1", "--rounds", "1", "--kernel-rounds", "1", "--only", "kernels,equal",
         "--cases", "torch,tds embedded", "--data", str(tmp_path / "images"),
         "--json", str(out)],
        capture_output=True, text=True, timeout=280, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pil_draft" in result.stdout and "tds embedded" in result.stdout
    rows = json.loads(out.read_text())
    kernels, torch_row, tds_row = rows[0], rows[1], rows[2]
    assert kernels["pil_full"] > 0 and kernels["pil_draft"] > 0
    assert (torch_row["case"], tds_row["case"]) == ("torch", "tds embedded")
    for row in (torch_row, tds_row):
        assert row["images_per_s"] > 0 and row["cpu_s_per_1000"] > 0
        assert row["first_batch_s"] > 0
    assert len(list((tmp_path / "images").glob("shard-*.tar"))) == 1
