"""The object the engine drives: one model step at a time, over one or several TP ranks.

Rank 0 lives in the caller's process. For TP > 1, `create_executor` starts one process per other
rank (or joins a `torchrun` job); each step's inputs are broadcast from rank 0, every rank runs
the forward, row-parallel outputs are all-reduced and the logits gathered on rank 0.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from inference_svc.loader.weights import LoadReport
from inference_svc.model.attention import AttentionMetadata
from inference_svc.model.config import ModelConfig
from inference_svc.model.parallel import TPGroup
from inference_svc.model.rank import RankModel

# Commands rank 0 broadcasts to the followers: header (8,) int64 = [command, args...].
_SHUTDOWN, _EXECUTE, _ALLOCATE_KV, _PROFILE = 0, 1, 2, 3
_HEADER = 8
DIST_TIMEOUT = timedelta(minutes=10)


class ModelExecutor(Protocol):
    config: ModelConfig
    tp_size: int

    def weight_bytes_per_rank(self) -> int: ...
    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None: ...
    def execute(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor: ...
    def profile_peak_activation_bytes(self, num_tokens: int, num_seqs: int) -> int: ...
    def shutdown(self) -> None: ...


class Executor:
    """Rank 0's executor (the only rank at TP=1)."""

    def __init__(
        self,
        rank_model: RankModel,
        tp_size: int,
        workers: list[Any],
        load_reports: list[LoadReport],
    ):
        self.config = rank_model.config
        self.tp_size = tp_size
        self.dtype = rank_model.dtype  # what the weights and KV cache hold at run time
        self.device = rank_model.device
        self.load_reports = load_reports  # one per rank, rank order
        self._rank = rank_model
        self._workers = workers
        self._comm = _comm_device(rank_model.device)
        self._closed = False

    def weight_bytes_per_rank(self) -> int:
        return self._rank.weight_bytes()

    def _command(self, *values: int) -> None:
        if self._closed:
            raise RuntimeError("executor is shut down")
        dead = [w for w in self._workers if not w.is_alive()]
        if dead:  # a collective with a dead rank would wait out the whole timeout
            raise RuntimeError(f"a TP worker exited (code {dead[0].exitcode}); shut down")
        if self.tp_size > 1:
            header = torch.zeros(_HEADER, dtype=torch.int64)
            header[: len(values)] = torch.tensor(values, dtype=torch.int64)
            dist.broadcast(header.to(self._comm), src=0)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._command(_ALLOCATE_KV, num_blocks, block_size)
        self._rank.allocate_kv_cache(num_blocks, block_size)

    def execute(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        # Checked before anything is broadcast: a step that fails on every rank would leave the
        # followers out of step with rank 0.
        check_step(input_ids, positions, meta, logits_indices, self.config.vocab_size,
                   self._rank.kv_caches)  # fmt: skip
        parts = [
            input_ids,
            positions,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables.reshape(-1),
            meta.slot_mapping,
            logits_indices,
        ]
        if self.tp_size > 1:
            t, b, width = input_ids.shape[0], meta.seq_lens.shape[0], meta.block_tables.shape[1]
            self._command(_EXECUTE, t, b, width, logits_indices.shape[0], meta.block_size)
            flat = torch.cat([p.reshape(-1).to(torch.int64).cpu() for p in parts])
            dist.broadcast(flat.to(self._comm), src=0)
        device = self._rank.device
        logits = self._rank.execute(
            input_ids.to(device), positions.to(device), meta.to(device), logits_indices.to(device)
        )
        assert logits is not None  # rank 0 always holds the gathered logits
        return logits

    def profile_peak_activation_bytes(self, num_tokens: int, num_seqs: int) -> int:
        self._command(_PROFILE, num_tokens, num_seqs)
        return self._rank.profile_peak_activation_bytes(num_tokens, num_seqs)

    def shutdown(self) -> None:
        if self._closed:
            return
        if self.tp_size > 1:
            with contextlib.suppress(RuntimeError):
                self._command(_SHUTDOWN)
        self._closed = True
        for w in self._workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
                w.join()
        if self.tp_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self._rank.kv_caches = []

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def check_step(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    logits_indices: torch.Tensor,
    vocab_size: int,
    kv_caches: list[torch.Tensor],
) -> None:
    """Raise ValueError for a step whose tensors disagree with each other or the cache."""
    if not kv_caches:
        raise RuntimeError("allocate_kv_cache before execute")
    _, num_blocks, block_size, _, _ = kv_caches[0].shape
    t = int(input_ids.shape[0]) if input_ids.dim() == 1 else -1
    if t < 0 or positions.shape != (t,) or meta.slot_mapping.shape != (t,):
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)}, positions {tuple(positions.shape)} and "
            f"slot_mapping {tuple(meta.slot_mapping.shape)} must all be (T,)"
        )
    if meta.block_size != block_size:
        raise ValueError(f"meta.block_size {meta.block_size} != the cache's {block_size}")
    starts, lens = meta.query_start_loc_list, meta.seq_lens_list
    if len(starts) != len(lens) + 1 or starts[0] != 0 or starts[-1] != t:
        raise ValueError(f"query_start_loc must run from 0 to {t} over {len(lens)} sequences")
    width = meta.block_tables.shape[1] if meta.block_tables.dim() == 2 else -1
    if meta.block_tables.shape[0] != len(lens) or width < 0:
        raise ValueError(f"block_tables {tuple(meta.block_tables.shape)} is not (B, W)")
    for i, ctx in enumerate(lens):
        n_new = starts[i + 1] - starts[i]
        if n_new < 0 or n_new > ctx or -(-ctx // block_size) > width:
            raise ValueError(f"sequence {i}: {n_new} new tokens, context {ctx}, {width} blocks")
    if t:
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size:
            raise ValueError(f"token ids must lie in [0, {vocab_size})")
        if int(meta.slot_mapping.max()) >= num_blocks * block_size:
            raise ValueError(f"slot_mapping points past the {num_blocks * block_size} cache slots")
    if meta.block_tables.numel() and (
        int(meta.block_tables.min()) < 0 or int(meta.block_tables.max()) >= num_blocks
    ):
        raise ValueError(f"block_tables hold ids outside [0, {num_blocks})")
    if logits_indices.dim() != 1 or (
        logits_indices.numel() and (int(logits_indices.min()) < 0 or int(logits_indices.max()) >= t)
    ):
        raise ValueError(f"logits_indices must be a 1-D tensor of token indices in [0, {t})")


def _comm_device(device: torch.device) -> torch.device:
    return device if device.type == "cuda" else torch.device("cpu")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _resolve(
    config: ModelConfig, dtype: torch.dtype | None, device: str
) -> tuple[torch.dtype, torch.device]:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)
    return (dtype or config.dtype), dev


def create_executor(
    model_dir: Path,
    *,
    tensor_parallel_size: int = 1,
    dtype: torch.dtype | None = None,
    device: str = "cpu",
) -> Executor:
    """Load `model_dir` over `tensor_parallel_size` ranks and return rank 0's executor.

    Under `torchrun` (RANK/WORLD_SIZE set, WORLD_SIZE == TP size) every rank calls this; ranks
    other than 0 serve rank 0's steps until it shuts down, then exit the process.
    """
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    config.check_tp(tensor_parallel_size)
    tp_size = tensor_parallel_size
    dtype, dev = _resolve(config, dtype, device)
    if tp_size == 1:
        rank_model = RankModel(model_dir, config, TPGroup(), dtype, dev)
        return Executor(rank_model, 1, [], [rank_model.load_report])
    if os.environ.get("WORLD_SIZE") == str(tp_size) and "RANK" in os.environ:
        return _join_torchrun(model_dir, config, tp_size, dtype, dev)
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed group already exists in this process")
    return _spawn(model_dir, config, tp_size, dtype, dev)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _spawn(
    model_dir: Path, config: ModelConfig, tp_size: int, dtype: torch.dtype, device: torch.device
) -> Executor:
    ctx = mp.get_context("spawn")
    port = _free_port()
    reports: Any = ctx.Queue()
    workers = []
    for rank in range(1, tp_size):
        dev = torch.device("cuda", rank) if device.type == "cuda" else device
        p = ctx.Process(
            target=_worker_main,
            args=(rank, tp_size, port, str(model_dir), dtype, str(dev), reports),
            daemon=True,
        )
        p.start()
        workers.append(p)
    try:
        # Enter the rendezvous only once every worker is up: one that died while starting
        # would otherwise leave rank 0 waiting in init_process_group until the timeout.
        _collect(reports, workers, "started")
        dist.init_process_group(
            _backend(device),
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=tp_size,
            timeout=DIST_TIMEOUT,
        )
        rank_model = RankModel(model_dir, config, TPGroup(0, tp_size), dtype, device)
        by_rank = {0: rank_model.load_report, **_collect(reports, workers, "ready")}
    except BaseException:
        for w in workers:
            w.kill()
            w.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    return Executor(rank_model, tp_size, workers, [by_rank[r] for r in range(tp_size)])


def _collect(reports: Any, workers: list[Any], kind: str) -> dict[int, Any]:
    """One `kind` message from every worker; a worker's error or death is raised here."""
    got: dict[int, Any] = {}
    while len(got) < len(workers):
        try:
            msg_kind, rank, payload = reports.get(timeout=0.5)
        except queue.Empty:
            dead = [w for w in workers if not w.is_alive()]
            if dead:
                raise RuntimeError(
                    f"a TP worker exited (code {dead[0].exitcode}) before it was {kind}"
                ) from None
            continue
        if msg_kind == "error":
            raise RuntimeError(f"TP rank {rank} failed:\n{payload}")
        if msg_kind != kind:
            raise RuntimeError(f"TP rank {rank} sent {msg_kind!r}, expected {kind!r}")
        got[rank] = payload
    return got


def _join_torchrun(
    model_dir: Path, config: ModelConfig, tp_size: int, dtype: torch.dtype, device: torch.device
) -> Executor:
    rank = int(os.environ["RANK"])
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    if not dist.is_initialized():
        dist.init_process_group(_backend(device), timeout=DIST_TIMEOUT)
    rank_model = RankModel(model_dir, config, TPGroup(rank, tp_size), dtype, device)
    reports: list[Any] = [None] * tp_size
    dist.all_gather_object(reports, rank_model.load_report)
    if rank != 0:
        _follow(rank_model)
        dist.destroy_process_group()
        raise SystemExit(0)
    return Executor(rank_model, tp_size, [], reports)


def _worker_main(
    rank: int,
    tp_size: int,
    port: int,
    model_dir: str,
    dtype: torch.dtype,
    device: str,
    reports: Any,
) -> None:
    """A spawned TP rank: load this rank's weights, report, then follow rank 0's commands."""
    dev = torch.device(device)
    if dev.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp_size))
    reports.put(("started", rank, None))
    dist.init_process_group(
        _backend(dev),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=tp_size,
        timeout=DIST_TIMEOUT,
    )
    try:
        config = ModelConfig.from_dir(Path(model_dir))
        rank_model = RankModel(Path(model_dir), config, TPGroup(rank, tp_size), dtype, dev)
    except BaseException:
        reports.put(("error", rank, traceback.format_exc()))
        raise
    reports.put(("ready", rank, rank_model.load_report))
    try:
        _follow(rank_model)
    finally:
        dist.destroy_process_group()


def _follow(rank_model: RankModel) -> None:
    """Serve rank 0's commands until it says shut down."""
    comm = _comm_device(rank_model.device)
    device = rank_model.device
    while True:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=comm)
        dist.broadcast(header, src=0)
        cmd, *args = (int(x) for x in header.cpu().tolist())
        if cmd == _SHUTDOWN:
            return
        if cmd == _ALLOCATE_KV:
            rank_model.allocate_kv_cache(args[0], args[1])
        elif cmd == _PROFILE:
            rank_model.profile_peak_activation_bytes(args[0], args[1])
        elif cmd == _EXECUTE:
            t, b, width, n_logits, block_size = args[:5]
            sizes = [t, t, b + 1, b, b * width, t, n_logits]
            flat = torch.empty(sum(sizes), dtype=torch.int64, device=comm)
            dist.broadcast(flat, src=0)
            ids, pos, qsl, lens, tables, slots, idx = flat.to(device).split(sizes)
            meta = AttentionMetadata(qsl, lens, tables.view(b, width), slots, block_size)
            rank_model.execute(ids, pos, meta, idx)
        else:
            raise RuntimeError(f"unknown TP command {cmd}")
