"""A reader with a cross-trainer cache is iterated once (tf.data service refuses a repeated
cached dataset): a second iter() would open a new job iteration whose cache starts at 0, so
trainers on different passes would silently stop sharing elements."""

from __future__ import annotations

import itertools

import pytest

import torch_dataservice as tds

pytestmark = pytest.mark.integration


@pytest.mark.timeout(60)
def test_a_cached_reader_iterated_again_is_refused(cluster_factory) -> None:
    cluster = cluster_factory(num_workers=1, num_processes=0)
    reader = tds.Pipeline.range(10**9).apply(tds.distribute(
        "parallel_epochs", cluster.target, job_name="cached-once",
        cross_trainer_cache=tds.CrossTrainerCache("a")))
    first = iter(reader)
    assert list(itertools.islice(first, 5)) == list(range(5))
    with pytest.raises(ValueError, match=r"trainer_id='a'\) may be iterated only once"):
        next(iter(reader))
    assert list(itertools.islice(first, 5)) == list(range(5, 10))  # the first one goes on
    first.close()
