"""The package exports exactly the public names of shared/API.md, lazily."""

import subprocess
import sys

import pytest

import torch_dataservice as tds

API_NAMES = {
    "DispatcherConfig", "DispatchServer", "WorkerConfig", "WorkerServer", "Pipeline",
    "ShardingPolicy", "SHARD_HINT", "CrossTrainerCache", "distribute", "register_dataset",
    "from_dataset_id", "DataLoader", "read_bytes", "CachedDataset",
}


def test_every_api_name_is_exported() -> None:
    assert API_NAMES <= set(tds.__all__)
    for name in tds.__all__:
        assert getattr(tds, name) is not None, name


def test_unknown_name_is_an_attribute_error() -> None:
    try:
        tds.NoSuchThing  # noqa: B018
    except AttributeError as error:
        assert "NoSuchThing" in str(error)
    else:
        raise AssertionError("expected AttributeError")


@pytest.mark.integration
def test_dispatcher_does_not_import_torch() -> None:
    # The dispatcher never runs user code: starting it must not pay for importing torch.
    code = (
        "import sys, torch_dataservice as t\n"
        "from torch_dataservice.dispatcher.server import DispatchServer\n"
        "s = t.DispatchServer(t.DispatcherConfig(host='127.0.0.1'))\n"
        "s.stop()\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False"
