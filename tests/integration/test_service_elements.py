"""Elements over the wire: nests of every supported type, compression, elements above 4 MB.

Every test here forces gRPC (`force_grpc`): this process reads its workers like a remote
trainer would, through the real frame and message size limits.
"""

from __future__ import annotations

import sys
from collections import namedtuple

import cloudpickle
import numpy as np
import pytest
import torch

import torch_dataservice as tds
from tests.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# Workers need not import this test module: functions and classes of it travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

Point = namedtuple("Point", ["x", "y"])


def assert_same(actual: object, expected: object) -> None:
    """Deep equality that also checks container and leaf types."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor)
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        assert torch.equal(actual, expected)
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray)
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        np.testing.assert_array_equal(actual, expected)
    elif isinstance(expected, dict):
        assert type(actual) is type(expected) and list(actual) == list(expected)
        for key in expected:
            assert_same(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert type(actual).__name__ == type(expected).__name__
        if hasattr(expected, "_fields"):
            assert actual._fields == expected._fields
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_same(a, e)
    else:
        assert type(actual) is type(expected) and actual == expected


def make_element(i: int) -> dict:
    return {
        "tensor": torch.arange(6, dtype=torch.float32).reshape(2, 3) * i,
        "long": torch.tensor([i, -i], dtype=torch.int64),
        "bool": torch.tensor([True, i % 2 == 0]),
        "half": torch.full((3,), i, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4),
        "scalar_tensor": torch.tensor(float(i)),
        "array": np.arange(4, dtype=np.int16) + i,
        "strided": np.arange(12).reshape(3, 4)[:, 1],
        "big_bytes": bytes([i % 256]) * 10_000,
        "nested": [(i, float(i) / 2, True), {"name": f"el-{i}", "raw": b"\x00\xff" * i}],
        "point": Point(torch.ones(2) * i, np.float64(i)),
        "none": None,
        "text": "é" * i,
        "complex": complex(i, -i),
    }


@pytest.mark.parametrize("compression", ["AUTO", None])
def test_nested_elements_round_trip(shared_cluster: Cluster, force_grpc: None,
                                    compression: str | None) -> None:
    pipeline = tds.Pipeline.range(4).map(make_element).apply(
        tds.distribute("distributed_epoch", shared_cluster.target, compression=compression))
    received = sorted(pipeline, key=lambda element: element["nested"][0][0])
    assert len(received) == 4
    for i, element in enumerate(received):
        assert_same(element, make_element(i))
        assert isinstance(element["point"], Point)
    # Decoded tensors own writable memory: a trainer may modify them in place.
    received[1]["tensor"].add_(1)


def test_plain_and_tuple_elements(shared_cluster: Cluster, force_grpc: None) -> None:
    cases = [3, 2.5, "text", b"bytes", None, (1, "a"), [torch.zeros(2)], True]
    pipeline = tds.Pipeline.from_items(list(range(len(cases)))).map(
        lambda i: cases[i]).apply(tds.distribute("distributed_epoch", shared_cluster.target))
    received = list(pipeline)
    assert len(received) == len(cases)
    by_repr = {repr(value): value for value in received}
    for case in cases:
        assert_same(by_repr[repr(case)], case)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("compression", ["AUTO", None])
def test_elements_of_16_and_20_megabytes(shared_cluster: Cluster, force_grpc: None,
                                         compression: str | None) -> None:
    sizes = [16 << 20, 20 << 20]

    def large(i: int) -> torch.Tensor:
        # Random bytes do not compress: the payload on the wire is as large as the element.
        generator = torch.Generator().manual_seed(i)
        return torch.randint(0, 256, (sizes[i],), dtype=torch.uint8, generator=generator)

    pipeline = tds.Pipeline.range(2).map(large).apply(
        tds.distribute("distributed_epoch", shared_cluster.target, compression=compression))
    received = sorted(pipeline, key=len)
    assert [element.numel() for element in received] == sizes
    for i, element in enumerate(received):
        assert torch.equal(element, large(i))
