"""Wire format: the element codec (nested tensors <-> bytes) and the GetElements reply frame."""

from torch_dataservice.wire.codec import COMPRESSION_AUTO, decode, encode, payload_size
from torch_dataservice.wire.frame import build_frame, parse_frame

__all__ = [
    "COMPRESSION_AUTO",
    "build_frame",
    "decode",
    "encode",
    "parse_frame",
    "payload_size",
]
