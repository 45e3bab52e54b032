"""Real ingest: JPEG decode and augmentation, torch's DataLoader against tds.DataLoader.

The workload users run: seeded synthetic JPEGs of ImageNet-like sizes (a tail of large ones),
decoded with Pillow, RandomResizedCrop(224) + flip (examples/image_ops.py), uint8 CHW, batches
of 64 (~9.6 MB). Every case runs in a fresh interpreter (`--case`), the servers it needs as CLI
processes; cases alternate round by round so a noisy machine hurts all alike.

Groups (`--only`):
  equal     equal cores: torch DataLoader(num_workers=N) vs tds.DataLoader embedded (N
            executors); tds against CLI servers over the Unix socket (target_workers="LOCAL")
            and over TCP ("ANY"); the fast decode path (JPEG draft mode) in torch and in tds.
  disagg    a trainer pinned to core 0 that simulates a GPU step per batch (`--step-ms`, a
            sleep, and a variant that burns CPU): torch's workers on core 0 (the GPU host's
            CPUs) vs a `torch-dataservice worker` pinned to core 1 (a remote CPU host, read
            over TCP), alone and together with a second worker on core 0.
  cache     `Pipeline.cache()` after decode + resize (256x256), before the random crop and
            flip, on one CLI worker, 5 epochs (each its own job): epoch 1 (computed and kept)
            against epochs 2-5 (read from the worker's cache) in CPU per image and images/s,
            and the worker's memory (RSS of its processes + its cache's shared memory) each
            epoch; beside the same pipeline without a cache and with max_bytes below the
            data (LRU over a cyclic scan: few hits, the memory bound is what it shows).
  kernels   decode + RandomResizedCrop per image on core 0 (5 interleaved rounds, the cheapest
            counts): Pillow's full decode, the draft path, the simplejpeg path, and tf.data's
            kernels (decode_and_crop_jpeg + non-antialiased resize) when
            `--tf-python` names an interpreter with tensorflow (kept out of this venv: its
            protobuf pins clash with ours).

Per case: images/s (from the first batch on), CPU-seconds per 1,000 images over every process
(trainer, its children, the servers), time to the first batch (from the loader's construction;
the loader's module is imported before, as torch's is), p50/p99 wait per batch, and the
share of the trainer's time spent waiting. Ratios are against torch's plain path in the same run.

    python benchmarks/ingest.py --quick                  # ~3 min
    python benchmarks/ingest.py                          # ~15 min
    python benchmarks/ingest.py --only disagg --step-ms 100
    python benchmarks/ingest.py --quick --only cache     # ~1 min
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import io
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
for _path in (ROOT, EXAMPLES):
    if _path not in sys.path:  # run as a script from a checkout without installing
        sys.path.insert(0, _path)

import numpy as np  # noqa: E402
import torch  # noqa: E402

BATCH = 64
LARGE_SHARE = 0.08  # images with a long side of 1000-2400 px (camera originals)


# ----------------------------------------------------------------------------- the data
def _synthetic_jpeg(rng: np.random.Generator) -> bytes:
    """A photo-like JPEG: smooth colour fields plus sensor-like noise, quality 90."""
    from PIL import Image

    long_side = int(rng.integers(1000, 2401) if rng.random() < LARGE_SHARE
                    else rng.integers(300, 501))
    aspect = float(rng.choice([4 / 3, 3 / 2, 1.0, 5 / 4]))
    w, h = long_side, max(64, int(long_side / aspect))
    if rng.random() < 0.3:
        w, h = h, w
    base = rng.integers(0, 256, (max(2, h // 48), max(2, w // 48), 3), dtype=np.uint8)
    image = np.asarray(Image.fromarray(base).resize((w, h), Image.BICUBIC), dtype=np.int16)
    image = image + rng.normal(0, 10, (h, w, 3)).astype(np.int16)
    buf = io.BytesIO()
    Image.fromarray(image.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def make_images(directory: str, count: int, seed: int, per_shard: int = 256) -> list[str]:
    """`count` JPEGs under `directory` (made once per seed and count), also as WebDataset
    tar shards of `per_shard` samples (`shard-NNNNN.tar`: KEY.jpg + KEY.cls)."""
    done = os.path.join(directory, "DONE")
    paths = [os.path.join(directory, f"{i:07d}.jpg") for i in range(count)]
    if os.path.exists(done):
        return paths
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    for start in range(0, count, per_shard):
        shard = os.path.join(directory, f"shard-{start // per_shard:05d}.tar")
        with tarfile.open(shard, "w") as tar:
            for i in range(start, min(count, start + per_shard)):
                data = _synthetic_jpeg(rng)
                with open(paths[i], "wb") as f:
                    f.write(data)
                for name, payload in ((f"{i:07d}.jpg", data), (f"{i:07d}.cls", b"%d" % (i % 1000))):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    with open(done, "w") as f:
        f.write(f"{count} {seed}\n")
    return paths


class JpegFiles(torch.utils.data.Dataset):
    """Map-style: `(uint8 CHW 224x224 image, label)` of each file, as an ImageFolder would."""

    def __init__(self, paths: list[str], fast: bool) -> None:
        self.paths = paths
        self.fast = fast

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        import image_ops

        with open(self.paths[index], "rb") as f:
            data = f.read()
        transform = image_ops.fast_train_transform if self.fast else image_ops.train_transform
        return transform(data), index % 1000


# ----------------------------------------------------------------------------- CPU
def tree_cpu(pid: int) -> float:
    """CPU-seconds of `pid` and its live descendants, with the children they reaped."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


# ----------------------------------------------------------------------------- a case
@dataclass
class Case:
    """One configuration, run in its own interpreter."""

    name: str
    loader: str = "torch"  # "torch" | "tds"
    fast: bool = False  # the draft-mode decode path
    num_workers: int = 2
    service: str = "embedded"  # "embedded" | "cli"
    target_workers: str = "AUTO"
    trainer_cores: list[int] | None = None  # pin the trainer (and torch's workers) here
    workers: list[tuple[list[int], int]] = field(default_factory=list)  # CLI: (cores, procs)
    step: str = "none"  # "none" | "sleep" | "burn": the simulated GPU step per batch


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        x += 1


def run_case(case: Case, paths: list[str], epochs: int, step_ms: float,
             address: str | None) -> dict:
    """Read `epochs` epochs of `paths` with `case`'s loader; figures as a dict."""
    import torch_dataservice as tds

    if case.trainer_cores is not None:
        os.sched_setaffinity(0, case.trainer_cores)
    import cloudpickle
    import image_ops

    cloudpickle.register_pickle_by_value(image_ops)  # CLI workers need not import it
    # Imported before the clock, as torch's DataLoader is by `import torch`: a script imports
    # its modules once at its start (`tds.DataLoader` is a lazy attribute of the package).
    loader_class = torch.utils.data.DataLoader if case.loader == "torch" else tds.DataLoader
    dataset = JpegFiles(paths, case.fast)
    cpu0 = tree_cpu(os.getpid())
    start = time.perf_counter()
    if case.loader == "torch":
        loader = loader_class(dataset, batch_size=BATCH, shuffle=True,
                              num_workers=case.num_workers)
    else:
        loader = loader_class(dataset, batch_size=BATCH, shuffle=True,
                              num_workers=case.num_workers, service=address,
                              target_workers=case.target_workers)
    waits: list[float] = []
    first_batch = None
    images = 0
    busy = 0.0
    for _ in range(epochs):
        it = iter(loader)
        while True:
            t = time.perf_counter()
            try:
                batch, _labels = next(it)
            except StopIteration:
                break
            now = time.perf_counter()
            if first_batch is None:
                first_batch = now - start
                steady_from = now
            else:
                waits.append(now - t)
                images += len(batch)
            assert batch.shape[1:] == (3, 224, 224) and batch.dtype == torch.uint8
            s = time.perf_counter()
            if case.step == "sleep":
                time.sleep(step_ms / 1000)
            elif case.step == "burn":
                _burn(step_ms / 1000)
            busy += time.perf_counter() - s
    elapsed = time.perf_counter() - steady_from
    cpu = tree_cpu(os.getpid()) - cpu0
    del loader
    waits.sort()
    return {
        "images": images, "seconds": elapsed, "images_per_s": images / elapsed,
        "first_batch_s": first_batch, "cpu_s": cpu,
        "wait_p50_ms": 1000 * statistics.median(waits),
        "wait_p99_ms": 1000 * waits[min(len(waits) - 1, int(0.99 * len(waits)))],
        "wait_share": sum(waits) / elapsed,
    }


# ----------------------------------------------------------------------------- servers
def _pinned(cores: list[int]):
    return lambda: os.sched_setaffinity(0, cores)


@contextlib.contextmanager
def servers(workers: list[tuple[list[int], int]], dispatcher_cores: list[int]
            ) -> Iterator[tuple[str, list[int]]]:
    """A CLI dispatcher and `workers` ((cores, executor processes) each), every process pinned
    to its cores; yields the service target and the server pids."""
    import socket

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, EXAMPLES, os.environ.get("PYTHONPATH", "")) if p))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    python = [sys.executable, "-m", "torch_dataservice"]  # from ROOT: `-m` imports from cwd
    children = [subprocess.Popen(
        [*python, "dispatcher", "--host", "127.0.0.1", "--port", str(port)], env=env, cwd=ROOT,
        preexec_fn=_pinned(dispatcher_cores), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)]
    for cores, processes in workers:
        children.append(subprocess.Popen(
            [*python, "worker", "--dispatcher", f"127.0.0.1:{port}", "--host", "127.0.0.1",
             "--processes", str(processes)], env=env, cwd=ROOT, preexec_fn=_pinned(cores),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        _wait_for_workers(f"127.0.0.1:{port}", len(workers))
        yield f"grpc://127.0.0.1:{port}", [c.pid for c in children]
    finally:
        for child in reversed(children):
            child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _wait_for_workers(address: str, count: int, timeout_s: float = 90.0) -> None:
    """Until the dispatcher lists `count` workers (the CLI's status RPC)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(
            [sys.executable, "-m", "torch_dataservice", "status", "--dispatcher", address,
             "--json"], capture_output=True, text=True, timeout=60, cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT))
        if out.returncode == 0 and len(json.loads(out.stdout).get("workers", [])) >= count:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{count} workers did not register with {address} in {timeout_s}s")


# ----------------------------------------------------------------------------- cache
CACHED_SIDE = 256


def decode_resized(path: str) -> torch.Tensor:
    """The step worth caching: read, decode whole, resize to 256x256 (uint8 CHW)."""
    from PIL import Image

    with Image.open(path) as image:
        image = image.convert("RGB").resize((CACHED_SIDE, CACHED_SIDE), Image.BILINEAR)
        return torch.from_numpy(np.ascontiguousarray(np.asarray(image).transpose(2, 0, 1)))


def random_crop_flip(image: torch.Tensor) -> torch.Tensor:
    """The step run every epoch: a random 224x224 crop, flipped with p=0.5."""
    top, left = np.random.randint(0, CACHED_SIDE - 224 + 1, size=2)
    crop = image[:, top:top + 224, left:left + 224]
    return (crop.flip(2) if np.random.rand() < 0.5 else crop).contiguous()


def _worker_memory(worker_pid: int) -> tuple[int, int]:
    """(RSS of the worker and its executors, bytes of its cache directory in /dev/shm)."""
    import glob

    import psutil

    root = psutil.Process(worker_pid)
    rss = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    cached = 0
    for directory in glob.glob(f"/dev/shm/tds-cache-{worker_pid}-*"):
        for folder, _, files in os.walk(directory):
            cached += sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    return rss, cached


def _cache_lookups(address: str) -> tuple[int, int]:
    """(hits, misses) of every worker's cache so far, as their heartbeats reported them."""
    from torch_dataservice.observability.status_text import fetch_status

    workers = fetch_status(address).workers
    return sum(w.cache_hits for w in workers), sum(w.cache_misses for w in workers)


def cache_epochs(paths: list[str], epochs: int, processes: int,
                 max_bytes: int | None, workers: int = 1) -> list[dict]:
    """`epochs` epochs (each its own job, DYNAMIC) of the pipeline on `workers` CLI workers
    sharing `processes` executors: with cache() and `max_bytes`, or (max_bytes 0) without a
    cache, the baseline. With several workers, the share of splits read from a cache shows
    split affinity at work."""
    import torch_dataservice as tds

    pipeline = tds.Pipeline.list_files(paths).map(decode_resized)
    if max_bytes != 0:
        pipeline = pipeline.cache(max_bytes=max_bytes)
    pipeline = pipeline.map(random_crop_flip).batch(BATCH)
    rows = []
    cores = list(range(len(os.sched_getaffinity(0))))
    each = max(1, processes // workers)
    with servers([(cores, each)] * workers, [0]) as (address, pids):
        everyone = [os.getpid(), *pids]
        for epoch in range(epochs):
            lookups = _cache_lookups(address)
            reader = pipeline.apply(tds.distribute("distributed_epoch", address,
                                                   job_name=f"cache-epoch-{epoch}"))
            iterator = iter(reader)
            next(iterator)  # from the first batch on (a job's start is not the cache's)
            cpu0 = sum(tree_cpu(pid) for pid in everyone)
            start = time.perf_counter()
            images = 0
            for batch in iterator:
                assert batch.shape[1:] == (3, 224, 224)
                images += len(batch)
            seconds = time.perf_counter() - start
            cpu = sum(tree_cpu(pid) for pid in everyone) - cpu0
            memory = [_worker_memory(pid) for pid in pids[1:]]
            rss, cached = sum(m[0] for m in memory), sum(m[1] for m in memory)
            time.sleep(1.5)  # the workers' next heartbeats carry the epoch's cache figures
            (hits, misses), (hits0, misses0) = _cache_lookups(address), lookups
            hits, misses = hits - hits0, misses - misses0
            hit_share = hits / (hits + misses) if hits + misses else 0.0
            rows.append({"epoch": epoch + 1, "images": images, "images_per_s": images / seconds,
                         "cpu_ms_per_image": 1000 * cpu / images, "worker_rss": rss,
                         "cache_shm": cached, "splits_from_cache": hit_share})
            print(f"  epoch {epoch + 1}: {images / seconds:7.1f} images/s "
                  f"{1000 * cpu / images:6.2f} CPU ms/image   worker RSS {rss / 2**20:6.0f} MiB"
                  f" + cache {cached / 2**20:5.0f} MiB   splits from cache "
                  f"{100 * hit_share:3.0f}%", flush=True)
    return rows


# ----------------------------------------------------------------------------- kernels
class TfKernels:
    """tf.data's kernels (decode_and_crop_jpeg, bilinear resize without antialiasing) on core
    0, in `python` (an interpreter with tensorflow), kept running so that its rounds
    interleave with ours: one line in, one pass over the images, its CPU ms per image out."""

    SCRIPT = r'''
import json, sys, time
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
blobs = [open(p, "rb").read() for p in sys.argv[1:]]
def rrc(data):
    shape = tf.image.extract_jpeg_shape(data)
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        shape, tf.zeros([0, 0, 4]), min_object_covered=0, aspect_ratio_range=(3 / 4, 4 / 3),
        area_range=(0.08, 1.0), max_attempts=10, use_image_if_no_bounding_boxes=True)
    y, x, _ = tf.unstack(begin); h, w, _ = tf.unstack(size)
    image = tf.image.decode_and_crop_jpeg(data, tf.stack([y, x, h, w]), channels=3)
    image = tf.image.resize(image, (224, 224), antialias=False)
    image = tf.image.random_flip_left_right(image)
    return tf.transpose(tf.cast(image, tf.uint8), (2, 0, 1))
fn = tf.function(rrc)
fn(tf.constant(blobs[0]))
print("ready", flush=True)
for _ in sys.stdin:
    start = time.process_time()
    for b in blobs:
        fn(tf.constant(b))
    print(1000 * (time.process_time() - start) / len(blobs), flush=True)
'''

    TIMEOUT_S = 600  # tensorflow's import, or one pass over the images

    def __init__(self, python: str, paths: list[str]) -> None:
        # Its log goes to a file: a pipe nobody reads while we wait for a line could fill.
        self.log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen([python, "-c", self.SCRIPT, *paths], text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.log, preexec_fn=_pinned([0]))
        self._line("ready")

    def _line(self, expect: str | None = None) -> str:
        """Its next line, within TIMEOUT_S; RuntimeError with its log's end otherwise."""
        ready, _, _ = select.select([self.process.stdout], [], [], self.TIMEOUT_S)
        line = self.process.stdout.readline().strip() if ready else ""
        if not line or (expect and line != expect):
            self.process.kill()
            self.process.wait(timeout=60)
            self.log.seek(0)
            waited = "" if ready else f"no answer in {self.TIMEOUT_S} s; "
            raise RuntimeError(f"tensorflow kernels failed: {waited}{self.log.read()[-2000:]}")
        return line

    def round(self) -> float:
        """One pass over the images: CPU ms per image."""
        self.process.stdin.write("round\n")
        self.process.stdin.flush()
        return float(self._line())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.log.close()


def kernel_costs(paths: list[str], count: int, rounds: int,
                 tf_python: str | None = None) -> dict[str, list[float]]:
    """CPU ms per image of decode + RandomResizedCrop(224) + flip on one thread (torch's
    intra-op threads too, as in DataLoader workers and executors), every kernel once per
    round, tf.data's too when `tf_python` names an interpreter with tensorflow: a list of
    the rounds' costs per kernel."""
    import image_ops

    blobs = []
    for path in paths[:count]:
        with open(path, "rb") as f:
            blobs.append(f.read())
    kernels = [("pil_full", image_ops.train_transform),
               ("pil_draft", image_ops.fast_train_transform)]
    try:
        import simplejpeg  # noqa: F401

        kernels.append(("simplejpeg_draft", image_ops.turbo_train_transform))
    except ImportError:
        print("(simplejpeg is not installed: no simplejpeg_draft row)")
    tf = TfKernels(tf_python, paths[:count]) if tf_python else None
    costs: dict[str, list[float]] = {name: [] for name, _ in kernels}
    threads, cores = torch.get_num_threads(), os.sched_getaffinity(0)
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {0})  # the core tf's kernels run on
    try:
        for _name, fn in kernels:
            torch.manual_seed(0)
            fn(blobs[0])
        for _ in range(rounds):  # interleaved, tf's pass too: a disturbance hits one round
            for name, fn in kernels:
                start = time.process_time()
                for blob in blobs:
                    fn(blob)
                costs[name].append(1000 * (time.process_time() - start) / len(blobs))
            if tf is not None:
                costs.setdefault("tf_decode_and_crop", []).append(tf.round())
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, cores)
        if tf is not None:
            tf.close()
    return costs


# ----------------------------------------------------------------------------- the cases
def cases(group: str, cores: int) -> list[Case]:
    """The configurations of `group` (see the module docstring)."""
    if group == "equal":
        one = [(list(range(cores)), cores)]
        return [
            Case("torch", "torch", num_workers=cores),
            Case("tds embedded", "tds", num_workers=cores),
            Case("tds CLI unix", "tds", num_workers=cores, service="cli",
                 target_workers="LOCAL", workers=one),
            Case("tds CLI tcp", "tds", num_workers=cores, service="cli",
                 target_workers="ANY", workers=one),
            Case("torch fast", "torch", fast=True, num_workers=cores),
            Case("tds fast", "tds", fast=True, num_workers=cores),
        ]
    if group == "disagg":
        made = []
        for step in ("sleep", "burn"):
            made += [
                Case(f"torch on core 0 (step {step})", "torch", num_workers=2,
                     trainer_cores=[0], step=step),
                Case(f"tds remote core 1 (step {step})", "tds", service="cli",
                     target_workers="ANY", trainer_cores=[0], workers=[([1], 1)], step=step),
                Case(f"tds remote core 1 + core 0 (step {step})", "tds", service="cli",
                     target_workers="ANY", trainer_cores=[0],
                     workers=[([1], 1), ([0], 1)], step=step),
            ]
        return made
    raise ValueError(f"unknown group {group!r}")


def run_in_subprocess(case: Case, args: argparse.Namespace) -> dict:
    """`case` in a fresh interpreter (with its CLI servers around it when it needs them)."""
    command = [sys.executable, os.path.abspath(__file__), "--case", json.dumps(asdict(case)),
               "--data", args.data, "--images", str(args.images), "--epochs",
               str(args.epochs), "--step-ms", str(args.step_ms), "--seed", str(args.seed)]
    with contextlib.ExitStack() as stack:
        server_pids: list[int] = []
        if case.service == "cli":
            address, server_pids = stack.enter_context(servers(case.workers, [0]))
            command += ["--address", address]
        before = sum(tree_cpu(pid) for pid in server_pids)
        out = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        after = sum(tree_cpu(pid) for pid in server_pids)
    if out.returncode != 0:
        raise RuntimeError(f"case {case.name!r} failed:\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["cpu_s"] += after - before
    return result


def summarise(name: str, runs: list[dict]) -> dict:
    """Medians over rounds (the images and CPU are totals)."""
    def median(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    images = sum(r["images"] for r in runs)
    return {"case": name, "images_per_s": median("images_per_s"),
            "cpu_s_per_1000": 1000 * sum(r["cpu_s"] for r in runs) / images,
            "first_batch_s": median("first_batch_s"), "wait_p50_ms": median("wait_p50_ms"),
            "wait_p99_ms": median("wait_p99_ms"), "wait_share": median("wait_share"),
            "rounds": [round(r["images_per_s"], 1) for r in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer images and rounds")
    parser.add_argument("--images", type=int, default=None, help="images per epoch")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per case and round")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every case")
    parser.add_argument("--only", default="equal,disagg,kernels",
                        help="comma-separated groups: equal, disagg, cache, kernels")
    parser.add_argument("--cases", default=None,
                        help="comma-separated case names to keep (the first is the baseline)")
    parser.add_argument("--step-ms", type=float, default=100.0,
                        help="the simulated GPU step per batch of 64 (disagg)")
    parser.add_argument("--seed", type=int, default=0, help="the synthetic images' seed")
    parser.add_argument("--data", default=None, help="where the images are made (kept)")
    parser.add_argument("--kernel-rounds", type=int, default=5,
                        help="kernels group: interleaved rounds, the cheapest counts (CPU time "
                             "still grows on a busy machine: caches and memory are shared)")
    parser.add_argument("--tf-python", default=None,
                        help="an interpreter with tensorflow, for the kernels group")
    parser.add_argument("--json", default=None, help="write the summary rows here")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--address", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.images = args.images or (512 if args.quick else 2048)
    rounds = args.rounds or (1 if args.quick else 3)
    args.data = args.data or os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"tds-ingest-{args.seed}-{args.images}")
    paths = make_images(args.data, args.images, args.seed)

    if args.case is not None:
        case = Case(**json.loads(args.case))
        print(json.dumps(run_case(case, paths, args.epochs, args.step_ms, args.address)))
        return
    # Bytecode for the package, as an installed one has it (pip compiles at install): under
    # PYTHONDONTWRITEBYTECODE every case's processes (the trainer, the embedded service)
    # would compile its modules from source again within the time to the first batch, which
    # torch's DataLoader, from site-packages, never does.
    compileall.compile_dir(os.path.join(ROOT, "torch_dataservice"), quiet=1)
    compileall.compile_dir(EXAMPLES, quiet=1)

    cores = len(os.sched_getaffinity(0))
    print(f"{args.images} JPEGs ({sum(os.path.getsize(p) for p in paths) / len(paths) / 1e3:.0f}"
          f" kB mean) in {args.data}; batch {BATCH}; {args.epochs} epochs per case, {rounds} "
          f"round(s); {cores} cores; load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    groups = args.only.split(",")
    if "kernels" in groups:
        rounds_ms = kernel_costs(paths, min(len(paths), 256), args.kernel_rounds, args.tf_python)
        costs = {name: min(ms) for name, ms in rounds_ms.items()}
        print("\ndecode + RandomResizedCrop(224) + flip, CPU ms per image on one core "
              f"(the cheapest of {args.kernel_rounds} interleaved rounds):")
        for name, ms in costs.items():
            print(f"  {name:20s} {ms:6.2f} ms   ({costs['pil_full'] / ms:.2f}x pil_full)")
        if "tf_decode_and_crop" in costs and "simplejpeg_draft" in costs:
            ratio = costs["tf_decode_and_crop"] / costs["simplejpeg_draft"]
            by_round = [tf / ours for tf, ours in zip(rounds_ms["tf_decode_and_crop"],
                                                      rounds_ms["simplejpeg_draft"], strict=True)]
            print(f"the fast path against tf.data's kernels: {ratio:.2f}x images per CPU-second "
                  f"(target >= 1.0: {'met' if ratio >= 1.0 else 'NOT met'}); round by round "
                  f"{', '.join(f'{r:.2f}x' for r in by_round)} (median "
                  f"{statistics.median(by_round):.2f}x)")
            costs["tf_vs_fast_by_round"] = by_round
        rows.append({"group": "kernels", **costs})
    if "cache" in groups:
        processes = len(os.sched_getaffinity(0))
        series = {}
        for label, max_bytes, workers in (
                ("no cache (baseline)", 0, 1), ("cache()", None, 1),
                ("cache(max_bytes=32 MiB)", 32 << 20, 1), ("cache(), 2 workers", None, 2)):
            print(f"\n{label} after decode + resize, 5 epochs:", flush=True)
            series[label] = epochs = cache_epochs(paths, 5, processes, max_bytes, workers)
            first, later = epochs[0], epochs[1:]
            cpu = statistics.median(e["cpu_ms_per_image"] for e in later)
            speed = statistics.median(e["images_per_s"] for e in later)
            peak = max(e["worker_rss"] + e["cache_shm"] for e in epochs)
            print(f"  epochs 2-5 against epoch 1 (same run): CPU per image "
                  f"{cpu / first['cpu_ms_per_image']:.2f}x, images/s "
                  f"{speed / first['images_per_s']:.2f}x; peak worker memory "
                  f"{peak >> 20} MiB; splits from cache in epochs 2-5 "
                  f"{100 * statistics.median(e['splits_from_cache'] for e in later):.0f}%",
                  flush=True)
        rows.append({"group": "cache", "series": series})
    for group in (g for g in groups if g not in ("kernels", "cache")):
        chosen = cases(group, cores)
        if args.cases:
            keep = args.cases.split(",")
            chosen = [case for case in chosen if case.name in keep]
            if not chosen:
                raise ValueError(f"--cases {args.cases!r} names no case of group {group!r}")
        runs: dict[str, list[dict]] = {case.name: [] for case in chosen}
        for round_number in range(rounds):
            order = chosen[round_number % len(chosen):] + chosen[:round_number % len(chosen)]
            for case in order:
                result = run_in_subprocess(case, args)
                runs[case.name].append(result)
                print(f"  round {round_number + 1} {case.name:36s} "
                      f"{result['images_per_s']:7.1f} images/s", flush=True)
        summary = [summarise(name, made) for name, made in runs.items()]
        base = summary[0]
        title = ("equal cores" if group == "equal"
                 else f"disaggregation, step {args.step_ms:.0f} ms per batch")
        print(f"\n{title} (ratios against {base['case']!r}, same run):")
        print(f"  {'case':36s} {'images/s':>9s} {'ratio':>6s} {'CPU s/1k':>9s} "
              f"{'1st batch':>9s} {'wait p50':>9s} {'p99':>7s} {'waiting':>8s}")
        for row in summary:
            row["group"] = group
            row["ratio"] = row["images_per_s"] / base["images_per_s"]
            row["cpu_ratio"] = row["cpu_s_per_1000"] / base["cpu_s_per_1000"]
            print(f"  {row['case']:36s} {row['images_per_s']:9.1f} {row['ratio']:5.2f}x "
                  f"{row['cpu_s_per_1000']:9.2f} {row['first_batch_s']:8.2f}s "
                  f"{row['wait_p50_ms']:7.1f}ms {row['wait_p99_ms']:5.0f}ms "
                  f"{100 * row['wait_share']:7.1f}%")
        rows += summary
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
