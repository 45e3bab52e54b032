"""tds.DataLoader yields what torch.utils.data.DataLoader yields for the same arguments."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, Dataset, IterableDataset, SequentialSampler

import torch_dataservice as tds
from tests.conftest import Cluster, subprocess_env
from torch_dataservice.worker import shm


class Records(Dataset):
    """Nests of tensors, ints and strings, as datasets return them."""

    def __init__(self, n: int = 23, slow_every: int = 0) -> None:
        self.n = n
        self.slow_every = slow_every

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        if self.slow_every and index % self.slow_every == 0:
            time.sleep(0.03)  # lets later batches overtake this one on another worker
        return {"x": torch.full((2,), float(index)), "i": index, "name": f"s{index}"}


def pair_collate(samples: list[dict]) -> tuple[torch.Tensor, list[str]]:
    return torch.stack([s["x"] for s in samples]).sum(1), [s["name"] for s in samples]


class Bucketed(BatchSampler):
    """A batch sampler with uneven batches."""

    def __init__(self) -> None:
        pass

    def __iter__(self) -> Iterator[list[int]]:
        return iter([[0, 1, 2], [3], [4, 5, 6, 7, 8], [9, 10], [22, 11, 12]])

    def __len__(self) -> int:
        return 5


def same(x: Any, y: Any) -> bool:
    """Exact equality of nests of tensors (same dtype and shape too) and Python values."""
    if isinstance(x, torch.Tensor):
        return (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
                and torch.equal(x, y))
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return (type(x) is type(y) and len(x) == len(y)
                and all(same(a, b) for a, b in zip(x, y, strict=True)))
    return type(x) is type(y) and x == y


def assert_same(ours: Any, theirs: Any) -> None:
    a, b = list(ours), list(theirs)
    assert len(a) == len(b)
    for position, (x, y) in enumerate(zip(a, b, strict=True)):
        assert same(x, y), (position, x, y)


GRID = [
    dict(),
    dict(batch_size=4),
    dict(batch_size=4, drop_last=True),
    dict(batch_size=None),
    dict(batch_size=5, shuffle=True),
    dict(batch_size=None, shuffle=True),
    dict(batch_size=3, shuffle=True, drop_last=True, collate_fn=pair_collate),
    dict(batch_sampler=Bucketed()),
    dict(sampler=SequentialSampler(range(7)), batch_size=2),
]


@pytest.mark.parametrize("kwargs", GRID, ids=lambda kw: ",".join(kw) or "defaults")
def test_same_batches_as_torch(cluster: Cluster, kwargs: dict) -> None:
    ours = tds.DataLoader(Records(), service=cluster.target,
                          generator=torch.Generator().manual_seed(3), **kwargs)
    theirs = torch.utils.data.DataLoader(Records(), generator=torch.Generator().manual_seed(3),
                                         **kwargs)
    assert isinstance(ours, torch.utils.data.DataLoader)
    assert len(ours) == len(theirs)
    for _ in range(2):  # the generator carries over from epoch to epoch as in torch
        assert_same(ours, theirs)


def test_global_rng_shuffle_matches_torch(cluster: Cluster) -> None:
    torch.manual_seed(11)
    ours = [b["i"].tolist() for b in tds.DataLoader(Records(), batch_size=6, shuffle=True,
                                                    service=cluster.target)]
    torch.manual_seed(11)
    theirs = [b["i"].tolist() for b in torch.utils.data.DataLoader(Records(), batch_size=6,
                                                                   shuffle=True)]
    assert ours == theirs


def test_two_workers_serve_one_in_order_loader(cluster_factory) -> None:
    two = cluster_factory(2, num_processes=0)  # executors on threads: no process start-up
    kwargs = dict(batch_size=2, shuffle=True)
    ours = tds.DataLoader(Records(40, slow_every=3), service=two.target,
                          generator=torch.Generator().manual_seed(0), **kwargs)
    theirs = torch.utils.data.DataLoader(Records(40), generator=torch.Generator().manual_seed(0),
                                         **kwargs)
    assert_same(ours, theirs)
    # Both workers took part (each has a task of the iteration that produced elements).
    unordered = tds.DataLoader(Records(40, slow_every=3), service=two.target, in_order=False,
                               **kwargs)
    seen = sorted(i for batch in unordered for i in batch["i"].tolist())
    assert seen == list(range(40))


class Countdown(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[dict]:
        return ({"v": torch.tensor([float(i)]), "i": i} for i in range(self.n))

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("kwargs", [dict(batch_size=3), dict(batch_size=3, drop_last=True),
                                    dict(batch_size=None)], ids=str)
def test_iterable_dataset_matches_torch(cluster: Cluster, kwargs: dict) -> None:
    ours = tds.DataLoader(Countdown(8), service=cluster.target, **kwargs)
    theirs = torch.utils.data.DataLoader(Countdown(8), **kwargs)
    assert len(ours) == len(theirs)
    assert_same(ours, theirs)


def test_pipeline_is_a_dataset(cluster: Cluster) -> None:
    pipeline = tds.Pipeline.range(10).map(lambda i: i * 10)
    # One worker process: DYNAMIC hands out the splits in order, so the order is torch's too.
    assert_same(tds.DataLoader(pipeline, batch_size=4, service=cluster.target),
                torch.utils.data.DataLoader(pipeline, batch_size=4))


def test_service_from_environment(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DATASERVICE_ADDRESS", cluster.address)
    loader = tds.DataLoader(Records(5), batch_size=2)
    assert [b["i"].tolist() for b in loader] == [[0, 1], [2, 3], [4]]


def test_worker_errors_reach_the_trainer(cluster: Cluster) -> None:
    class Broken(Records):
        def __getitem__(self, index: int) -> dict:
            if index == 3:
                raise KeyError("no sample 3")
            return super().__getitem__(index)

    with pytest.raises(tds.RemoteError, match="no sample 3") as info:
        list(tds.DataLoader(Broken(6), batch_size=2, service=cluster.target))
    assert "KeyError" in info.value.remote_type


def test_timeout_raises_like_torch(cluster: Cluster) -> None:
    class Slow(Records):
        def __getitem__(self, index: int) -> dict:
            time.sleep(1.0)
            return super().__getitem__(index)

    loader = tds.DataLoader(Slow(1), service=cluster.target, timeout=0.2)
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after 0.2 seconds"):
        next(iter(loader))


def test_pin_memory_without_accelerator_warns_and_yields(cluster: Cluster) -> None:
    if torch.accelerator.is_available():
        pytest.skip("pins for real on an accelerator")
    loader = tds.DataLoader(Records(3), batch_size=3, pin_memory=True, service=cluster.target)
    with pytest.warns(UserWarning, match="pin_memory"):
        batches = list(loader)
    assert batches[0]["i"].tolist() == [0, 1, 2] and not batches[0]["x"].is_pinned()


def test_arguments_are_checked_like_torch() -> None:
    with pytest.raises(ValueError, match="mutually exclusive with shuffle"):
        tds.DataLoader(Records(), sampler=SequentialSampler(range(3)), shuffle=True)
    with pytest.raises(ValueError, match="num_workers option should be non-negative"):
        tds.DataLoader(Records(), num_workers=-1)
    with pytest.raises(ValueError, match="prefetch_factor option could only be specified"):
        tds.DataLoader(Records(), prefetch_factor=2)
    with pytest.raises(ValueError, match="persistent_workers option needs num_workers"):
        tds.DataLoader(Records(), persistent_workers=True)
    with pytest.raises(ValueError, match="expected unspecified shuffle"):
        tds.DataLoader(Countdown(3), shuffle=True)
    with pytest.raises(ValueError, match="'bogus'"):
        tds.DataLoader(Records(), processing_mode="bogus")
    with pytest.raises(ValueError, match="job_name"):
        tds.DataLoader(Records(), job_name="")
    with pytest.raises(ValueError, match="compression"):
        tds.DataLoader(Records(), compression="zstd")
    loader = tds.DataLoader(Records(), num_workers=4, prefetch_factor=3, persistent_workers=True)
    assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (4, 3, True)


MAIN_SCRIPT = """
    import torch
    from torch.utils.data import Dataset
    import torch_dataservice as tds
    from sibling import Offset  # a module next to the script, imported by the workers too

    class Squares(Dataset):  # defined in __main__: travels to the workers by value
        def __len__(self):
            return 10
        def __getitem__(self, i):
            return torch.tensor([i * i]), Offset(i).value

    def collate(samples):
        return torch.cat([s[0] for s in samples]), [s[1] for s in samples]

    kwargs = dict(batch_size=3, shuffle=True, collate_fn=collate)
    ours = tds.DataLoader(Squares(), generator=torch.Generator().manual_seed(1), **kwargs)
    theirs = torch.utils.data.DataLoader(Squares(), generator=torch.Generator().manual_seed(1),
                                         **kwargs)
    a = [(x.tolist(), y) for x, y in ours]
    b = [(x.tolist(), y) for x, y in theirs]
    assert a == b, (a, b)
    print("OK", len(a))
"""


@pytest.mark.integration
def test_main_module_code_and_embedded_service(tmp_path) -> None:
    (tmp_path / "sibling.py").write_text(
        "class Offset:\n    def __init__(self, i):\n        self.value = i + 100\n")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(MAIN_SCRIPT))
    env = subprocess_env()
    env.pop("TORCH_DATASERVICE_ADDRESS", None)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env, cwd=str(tmp_path), timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "OK 4"


def test_loaders_with_one_job_name_share_each_epoch(cluster: Cluster) -> None:
    import threading

    loaders = [tds.DataLoader(Records(30), batch_size=2, service=cluster.target,
                              job_name="shared-records") for _ in range(2)]
    got: list[list[int]] = [[], []]

    def read(k: int) -> None:
        got[k] = [i for batch in loaders[k] for i in batch["i"].tolist()]

    threads = [threading.Thread(target=read, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(got[0] + got[1]) == list(range(30))  # first come, first served


class Images(Dataset):
    """(3, 64, 64) uint8 images of noise seeded by their index (not worth compressing, as
    decoded photos), and the index: a batch of 128 is 1.5 MB, so an executor stacks it into
    one of its segments (pipeline/collate.py)."""

    def __len__(self) -> int:
        return 1024

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(index)
        return torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8,
                             generator=generator), index


@pytest.mark.timeout(120)
def test_big_batches_stacked_in_the_executor_are_torchs(cluster: Cluster) -> None:
    """Through the cluster's executor process, over its Unix socket or TCP: every batch is
    what torch's DataLoader collates, none overwritten by a later one while all are kept."""
    expected = list(torch.utils.data.DataLoader(Images(), batch_size=128))
    for target_workers in ("ANY", "LOCAL"):
        kept = list(tds.DataLoader(Images(), batch_size=128, num_workers=2,
                                   service=cluster.target, target_workers=target_workers))
        assert len(kept) == len(expected) == 8
        for (images, labels), (want_images, want_labels) in zip(kept, expected, strict=True):
            assert images.shape == (128, 3, 64, 64) and torch.equal(labels, want_labels)
            assert torch.equal(images, want_images)
        if target_workers == "LOCAL":  # read in this process: each batch is where it was
            spans = _segment_spans()  # stacked, not at its payload's start (a copy's place)
            for images, _ in kept:
                start = max(s for s in spans if s <= images.data_ptr())
                assert images.data_ptr() - start == shm.ARRAY_OFFSET


def _segment_spans() -> set[int]:
    """Start addresses of this process's mappings of executors' segments."""
    with open("/proc/self/maps") as maps:
        return {int(line.split("-", 1)[0], 16) for line in maps if "tds-segment" in line}
