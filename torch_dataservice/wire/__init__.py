"""Wire format: the element codec (codec.py: nested tensors <-> bytes), the GetElements reply
frame (frame.py), the data-port protocol, what stays in this process (inprocess.py) and a
split's names (splits.py). Nothing is imported here: the dispatcher uses `wire.splits` and must
not pay for the codec's torch (tests/test_public_api.py)."""
