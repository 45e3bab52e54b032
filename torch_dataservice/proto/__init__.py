"""Generated protobuf and gRPC modules for protos/torch_dataservice/v1/*.proto.

Do not edit the *_pb2*.py files by hand; regenerate them with `make protos`
(scripts/gen_protos.py). tests/test_protos_fresh.py fails when they are stale.
"""
