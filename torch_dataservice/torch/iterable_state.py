"""`tds.DataLoader` state for Pipelines and IterableDatasets under DYNAMIC: the splits.

Under DYNAMIC sharding the dispatcher hands an epoch out as splits and workers tag every
element (here: every batch) with (split repetition, split index, offset). The loader reads
its epoch through a `TaggedSource` (the job's `IterationReader`, the tag beside each batch),
and the iterator records the tag of each batch when `next()` returns it to the trainer
(loader_iter.py, `Progress.consumed`): the state is what the trainer yielded, never what
the service produced or the reader prefetched ahead.

`state_dict()` is then world-size independent: under torch.distributed it is a collective
(`all_gather_object` over the default group, so every rank calls it at the same step) that
merges every rank's consumed splits, completes those read whole with the dispatcher's split
sizes (GetSplitSizes), and returns the same small JSON-able dict on every rank: the epoch,
whole splits as index ranges, partly read ones as a prefix count (+ the few offsets beyond).
`load_state_dict()` at any world size makes that epoch's job a resumed one
(`JobConfig.resume`, dispatcher/resume.py): its splits are exactly the unconsumed remainder,
shared by the new ranks as any epoch is (coordinated reads with `even_batches`); the following
epochs go on as usual.

Exact when every batch lies within one split and a split yields the same batches in the same
order on any worker: a source cut in splits followed by per-element steps (map, filter,
flat_map), batched by the loader with a split size that is a multiple of `batch_size` (or
unbatched). Approximate otherwise: a batch that spans two splits is tagged with the later one
(the worker's tag is the split its source read last), so a resume may repeat or drop the
elements of the earlier split it holds; a shuffle buffer, interleave or anything else mixing
splits on the worker makes the (split, offset) tag describe the stream position only, and a
pipeline that is not deterministic per split (random augmentation without a per-split seed,
a source whose files changed) yields other elements at the same offsets.
An IterableDataset's shards are its splits (one per torch worker): a partly read shard is run
again on resume and its yielded batches skipped, so the shard must be deterministic (its seeds
are the restored epoch's). Not used for OFF or static sharding (no splits), which keep the
per-rank count of batches, nor for an IterableDataset read by one process, whose state keeps
torch's in-order resume (a count) unless it loads a split state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import torch.distributed as dist

from torch_dataservice.client.api import ReadOptions, connect_timeout_s, split_sizes
from torch_dataservice.client.consumed import ConsumedSplits
from torch_dataservice.pipeline import Pipeline
from torch_dataservice.pipeline.sources import SplittableSource, default_split_size
from torch_dataservice.policies import ShardingPolicy
from torch_dataservice.torch import state
from torch_dataservice.torch.loader_iter import Reading, read_arrivals, reading_from
from torch_dataservice.torch.registration import IterableJob

logger = logging.getLogger(__name__)


@dataclass
class Resume:
    """A loaded split state, until the epoch it describes starts."""

    epoch: int
    consumed: ConsumedSplits
    saved: dict[str, Any]  # as loaded: what state_dict() returns before the epoch starts


def applies(loader: Any) -> bool:
    """The loader's iterable epochs are read and saved by splits (see the module docstring)."""
    if not loader._tds_iterable or loader._tds_policy != ShardingPolicy.DYNAMIC:
        return False
    if isinstance(loader.dataset, Pipeline):
        return loader.dataset.is_splittable
    return loader._tds_ranks.distributed


def reads(loader: Any, epoch: int) -> bool:
    """Epoch `epoch` is read tagged: it resumes a split state, or the loader saves by splits
    (unless the epoch resumes a state of the older kind, a count of batches to skip)."""
    resume = _resume(loader)
    if resume is not None and resume.epoch == epoch:
        return True
    progress = loader._tds_progress
    return applies(loader) and not (progress is not None and progress.yielded > 0)


def saves(loader: Any) -> bool:
    """`state_dict()` is made here: a split state is pending or being read, or the loader
    saves by splits (a count state pending or being read keeps its own kind)."""
    if loader._tds_epochs.pending is not None:
        return _resume(loader) is not None
    progress = loader._tds_progress
    if progress is not None and not progress.finished:
        return progress.consumed is not None
    return applies(loader)


def _resume(loader: Any) -> Resume | None:
    return getattr(loader, "_tds_resume", None)


# ---------------------------------------------------------------------- reading
def aligned(dataset: Pipeline, batch_size: int | None) -> Pipeline:
    """`dataset` with its default split size rounded up to a multiple of `batch_size`, so
    that the workers' batches of an element-wise chain never span two splits (the state is
    then exact, see the module docstring). A split size the user chose is kept, and so is a
    split of files of many elements each (tar shards), which no batch size divides."""
    source = dataset.source
    if (not batch_size or not isinstance(source, SplittableSource)
            or not source.one_element_per_item):
        return dataset
    size = source.split_size or 1
    if size % batch_size == 0 or size != default_split_size(source.num_elements):
        return dataset
    return dataset.with_split_size(-(-size // batch_size) * batch_size)


class TaggedSource:
    """One iterable epoch's job, read as `(tag, batch)` pairs: `tag` is the batch's (split
    repetition, split index, offset), or None if untagged."""

    def __init__(self, job: IterableJob, max_outstanding: int | None,
                 resume: ConsumedSplits | None) -> None:
        options = ReadOptions.build(job.policy, job.service, job.job_name, job.consumer_index,
                                    job.num_consumers, max_outstanding, None,
                                    job.target_workers)
        # Job names are scoped by dataset, as from_dataset_id scopes them.
        name = f"{job.dataset_id}/{job.job_name}" if job.job_name is not None else ""
        self._config = options.job_config(job.dataset_id, name)
        if resume is not None:
            self._config.resume.CopyFrom(resume.to_proto())
        self._options = options
        self._consumer_index = job.consumer_index
        self._reader: Any = None

    def open(self) -> TaggedSource:
        """Join the job (on the loader's reading thread, as the Pipeline reader would)."""
        from torch_dataservice.client.reader import IterationReader

        self._reader = IterationReader(
            self._options.address, self._config, 0, self._options.max_outstanding_requests,
            connect_timeout_s(), consumer_index=self._consumer_index)
        return self

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return self

    def __next__(self) -> tuple[Any, Any]:
        element = next(self._reader)
        return self._reader.last_tag, element

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()

    def sizes(self, keys: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
        """The element counts the dispatcher knows of these splits of the epoch's iteration."""
        reader = self._reader
        if reader is None or not keys:
            return {}
        try:
            return split_sizes(self._options.address, reader.iteration_id, keys)
        except grpc.RpcError as error:
            # The iteration is gone (collected, or a dispatcher restarted without a journal):
            # the state keeps those splits' consumed offsets, which resumes them as exactly
            # (a split read whole is handed again and its worker skips every element).
            logger.warning("split sizes unknown (%s): the state lists %d split(s) by offsets",
                           error.code(), len(keys))
            return {}


def reading(loader: Any, pipeline: Pipeline, epoch: int, shards: bool) -> Reading:
    """Register epoch `epoch`'s pipeline and read it tagged, resumed if a loaded state says
    so. `shards`: an IterableDataset's `(shard, j, batch)` elements."""
    registrar = loader._tds_registrar
    resume = _resume(loader)
    consumed = None
    if resume is not None:
        loader._tds_resume = None
        if resume.epoch == epoch:
            consumed = resume.consumed
    progress = loader._tds_progress
    progress.consumed = consumed.copy() if consumed is not None else ConsumedSplits()
    source = TaggedSource(registrar.iterable_job(pipeline, epoch), registrar.max_outstanding,
                          consumed)
    progress.source = source
    return reading_from(source.open, lambda opened, emit: read_arrivals(
        opened, emit, 0, True, shards))


# ---------------------------------------------------------------------- state
def state_dict(loader: Any) -> dict[str, Any]:
    """The loader's state, the same on every rank (a collective under torch.distributed)."""
    mine = _local(loader)
    ranks = loader._tds_ranks
    if ranks.process_group and ranks.world_size > 1:
        gathered: list[Any] = [None] * ranks.world_size
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    return _merged(gathered, ranks.world_size)


def _local(loader: Any) -> dict[str, Any]:
    """This rank's share: its base state, and what it consumed of the epoch it reads."""
    planner = loader._tds_epochs
    resume = _resume(loader)
    if planner.pending is not None and resume is not None:
        return {"saved": resume.saved}
    saved = {"base_seed": planner.seed, "seeded": planner.seeded, "rank": 0,
             "world_size": loader._tds_ranks.world_size, "worker_seed": planner.worker_seed,
             "worker_round": planner.round, "positions": None, "consumed": None}
    progress = loader._tds_progress
    if progress is None or progress.consumed is None:
        rng = None if planner.seeded else _rng_snapshot(loader)
        saved.update(epoch=planner.next_epoch, batches_yielded=0, in_progress=False,
                     rng=state.encode_rng(rng))
        return {"saved": saved}
    consumed = progress.consumed.copy()
    sizes = progress.source.sizes(consumed.partial_keys()) if progress.source else {}
    saved.update(epoch=progress.epoch, batches_yielded=progress.yielded, in_progress=True,
                 rng=state.encode_rng(progress.rng))
    # A finished epoch: the next one draws from the RNG as it is now (not at the epoch's start).
    next_rng = None if planner.seeded or not progress.finished else _rng_snapshot(loader)
    return {"saved": saved, "finished": progress.finished, "next_epoch": planner.next_epoch,
            "next_rng": state.encode_rng(next_rng),
            "consumed": consumed.to_data(), "sizes": [[*k, n] for k, n in sizes.items()]}


def _merged(shares: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
    """One state from every rank's share: the epoch some rank is still reading, with every
    rank's consumption of it, or (all done) the next epoch."""
    reading = [s for s in shares if "consumed" in s and not s["finished"]]
    if not reading:
        done = [s for s in shares if "consumed" in s]
        if not done:
            return dict(shares[0]["saved"])
        saved = dict(done[0]["saved"])
        saved.update(epoch=done[0]["next_epoch"], batches_yielded=0, in_progress=False,
                     rng=done[0]["next_rng"])
        return saved
    epoch = max(s["saved"]["epoch"] for s in reading)
    same = [s for s in shares if "consumed" in s and s["saved"]["epoch"] == epoch]
    consumed = ConsumedSplits()
    sizes: dict[tuple[int, int], int] = {}
    for share in same:
        consumed.update(ConsumedSplits.from_data(share["consumed"]))
        sizes.update({(r, i): n for r, i, n in share["sizes"]})
    consumed.complete_with(sizes)
    saved = dict(same[0]["saved"])
    saved.update(batches_yielded=sum(s["saved"]["batches_yielded"] for s in same),
                 world_size=world_size, consumed=consumed.to_data())
    return saved


def _rng_snapshot(loader: Any) -> Any:
    from torch_dataservice.torch import sampling

    return sampling.rng_snapshot(loader)


def loading(loader: Any, loaded: Any) -> Any:
    """`load_state_dict`'s input, with a split state noted for its epoch: that epoch is read
    from a resumed job, so no batch is skipped by count (a state of another kind is returned
    as it is)."""
    loader._tds_resume = None
    if not isinstance(loaded, Mapping) or loaded.get("consumed") is None:
        return loaded
    consumed = ConsumedSplits.from_data(loaded["consumed"])
    epoch = loaded.get("epoch")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"state 'epoch' must be an int >= 0, got {epoch!r}")
    loader._tds_resume = Resume(epoch, consumed, dict(loaded))
    ranks = loader._tds_ranks
    return {**loaded, "batches_yielded": 0, "rank": ranks.rank, "world_size": ranks.world_size}
