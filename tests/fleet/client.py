"""A reader on a fleet host: reads EPOCHS DYNAMIC epochs of range(N) (one Pipeline iterated
again, as a training loop does), writes epoch e's elements to OUT.e (one per line, flushed
every 64, then "done") and prints "epoch E: COUNT in SECONDS s"; on an error prints
"refused TYPE: MESSAGE" and exits 1, so that the test can assert the error a user sees.
RATE (elements/s, counted from the first element; 0: unlimited) stretches an epoch so that
a fault lands inside it.

    python -m tests.fleet.client SERVICE N [EPOCHS [OUT [RATE]]]
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import TextIO

import torch_dataservice as tds


def read_epoch(pipeline: tds.Pipeline, out: TextIO | None, rate: float) -> int:
    count = 0
    first = 0.0
    lines: list[str] = []
    for element in pipeline:
        count += 1
        if count == 1:
            first = time.monotonic()
        lines.append(f"{int(element)}\n")
        if len(lines) == 64 and out is not None:
            out.write("".join(lines))
            out.flush()
            lines.clear()
        if rate:
            time.sleep(max(0.0, count / rate - (time.monotonic() - first)))
    if out is not None:
        out.write("".join(lines) + "done\n")
    return count


def main() -> int:
    service, n = sys.argv[1], int(sys.argv[2])
    epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    out = sys.argv[4] if len(sys.argv) > 4 else None
    rate = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    try:  # registering the pipeline is the first call to the dispatcher
        pipeline = tds.Pipeline.range(n).apply(tds.distribute("distributed_epoch", service))
        for epoch in range(epochs):
            began = time.monotonic()
            with open(f"{out}.{epoch}", "w") if out else contextlib.nullcontext() as sink:
                count = read_epoch(pipeline, sink, rate)
            print(f"epoch {epoch}: {count} in {time.monotonic() - began:.1f} s", flush=True)
    except Exception as error:  # what the user sees is what the test asserts
        print(f"refused {type(error).__name__}: {error}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
