"""A reader-side repeat over a shared job (issue 9.3): a pass that the job's other readers
consumed is empty, and the repeat goes on to the job's next iterations, as tf.data service's;
a late joiner joins where the job is. Real servers."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

import torch_dataservice as tds

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
N = 50


def _reader(target: str, job_name: str, count: int | None) -> tds.Pipeline:
    return tds.Pipeline.range(N).apply(tds.distribute(
        "distributed_epoch", target, job_name=job_name)).repeat(count)


def test_a_repeat_whose_first_pass_was_consumed_by_another_reader_runs_its_passes(
        shared_cluster) -> None:
    first = list(_reader(shared_cluster.target, "shared-repeat", 3))
    assert Counter(first) == Counter(list(range(N)) * 3)
    # The job's passes 0..2 are consumed: this reader's first pass (the job's iteration 0) is
    # empty, its second catches up with the job's latest (2, empty too), and its third is the
    # job's next iteration: it runs its three passes instead of stopping at the first.
    second = list(_reader(shared_cluster.target, "shared-repeat", 3))
    assert Counter(second) == Counter(range(N))


def test_a_late_joiners_infinite_repeat_joins_the_job_where_it_is(shared_cluster) -> None:
    assert len(list(_reader(shared_cluster.target, "late-join", 2))) == 2 * N
    late = list(itertools.islice(iter(_reader(shared_cluster.target, "late-join", None)),
                                 2 * N))
    assert Counter(late) == Counter(list(range(N)) * 2)


def test_an_empty_dataset_still_ends_a_repeat_over_a_named_job(shared_cluster) -> None:
    empty = tds.Pipeline.range(N).filter(lambda x: x < 0).apply(tds.distribute(
        "distributed_epoch", shared_cluster.target, job_name="empty-repeat")).repeat()
    assert list(empty) == []
