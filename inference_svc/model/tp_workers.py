"""Tensor-parallel ranks: started by the service (spawn) or by `torchrun`, one per process.

Rank 0 drives; the others follow. Each command is an (8,) int64 header broadcast from rank 0,
[command, args...], followed for a step by one int64 tensor holding all of the step's inputs.
Spawned groups use their own TCPStore and c10d process group (no global default group).
"""

from __future__ import annotations

import os
import queue
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from inference_svc.loader.weights import LoadReport
from inference_svc.model.attention import AttentionMetadata
from inference_svc.model.config import ModelConfig
from inference_svc.model.parallel import TPGroup
from inference_svc.model.rank import RankModel

SHUTDOWN, EXECUTE, ALLOCATE_KV, PROFILE = 0, 1, 2, 3
HEADER = 8
DIST_TIMEOUT = timedelta(minutes=10)


def comm_device(device: torch.device) -> torch.device:
    """Where collectives run: the GPU for NCCL, the CPU for gloo."""
    return device if device.type == "cuda" else torch.device("cpu")


def make_group(store: Any, rank: int, size: int, device: torch.device) -> TPGroup:
    """A process group of our own on `store`: NCCL for CUDA devices, gloo otherwise."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = DIST_TIMEOUT
        pg: Any = dist.ProcessGroupNCCL(store, rank, size, opts)
    else:
        pg = dist.ProcessGroupGloo(store, rank, size, DIST_TIMEOUT)
    return TPGroup(rank, size, pg)


def send_command(tp: TPGroup, device: torch.device, *values: int) -> None:
    header = torch.zeros(HEADER, dtype=torch.int64)
    header[: len(values)] = torch.tensor(values, dtype=torch.int64)
    tp.broadcast(header.to(comm_device(device)))


def send_step(
    tp: TPGroup,
    device: torch.device,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    logits_indices: torch.Tensor,
) -> None:
    """Broadcast one step's inputs from rank 0 (the followers rebuild them in `follow`)."""
    t, b, width = input_ids.shape[0], meta.seq_lens.shape[0], meta.block_tables.shape[1]
    send_command(tp, device, EXECUTE, t, b, width, logits_indices.shape[0], meta.block_size)
    parts = [input_ids, positions, meta.query_start_loc, meta.seq_lens, meta.block_tables,
             meta.slot_mapping, logits_indices]  # fmt: skip
    flat = torch.cat([p.reshape(-1).to(torch.int64).cpu() for p in parts])
    tp.broadcast(flat.to(comm_device(device)))


def spawn(
    model_dir: Path, config: ModelConfig, tp_size: int, dtype: torch.dtype, device: torch.device
) -> tuple[RankModel, list[Any], list[LoadReport]]:
    """Start ranks 1.. as processes, load rank 0 here; returns rank 0, the workers, all reports."""
    ctx = mp.get_context("spawn")
    # Port 0: the OS picks a free port for the store, which the workers are then told.
    store = dist.TCPStore(
        "127.0.0.1", 0, tp_size, is_master=True, timeout=DIST_TIMEOUT, wait_for_workers=False
    )
    reports: Any = ctx.Queue()
    workers = []
    for rank in range(1, tp_size):
        dev = torch.device("cuda", rank) if device.type == "cuda" else device
        p = ctx.Process(
            target=_worker_main,
            args=(rank, tp_size, store.port, str(model_dir), dtype, str(dev), reports),
            daemon=True,
        )
        p.start()
        workers.append(p)
    try:
        # Form the group only once every worker is up: one that died while starting would
        # otherwise leave rank 0 waiting in the rendezvous until the timeout.
        _collect(reports, workers, "started")
        tp = make_group(store, 0, tp_size, device)
        rank_model = RankModel(model_dir, config, tp, dtype, device)
        by_rank = {0: rank_model.load_report, **_collect(reports, workers, "ready")}
    except BaseException:
        for w in workers:
            w.kill()
            w.join()
        raise
    rank_model.store = store  # the workers' rendezvous point lives as long as the group
    return rank_model, workers, [by_rank[r] for r in range(tp_size)]


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


def join_torchrun(
    model_dir: Path, config: ModelConfig, tp_size: int, dtype: torch.dtype, device: torch.device
) -> tuple[RankModel, list[LoadReport]]:
    """Join the torchrun job; rank 0 returns, the others follow until shutdown, then exit."""
    rank = int(os.environ["RANK"])
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # torchrun's env:// rendezvous, as every torchrun job does
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=DIST_TIMEOUT)
    tp = TPGroup(rank, tp_size, dist.group.WORLD)
    rank_model = RankModel(model_dir, config, tp, dtype, device)
    reports: list[Any] = [None] * tp_size
    dist.all_gather_object(reports, rank_model.load_report)
    if rank != 0:
        follow(rank_model)
        dist.destroy_process_group()
        raise SystemExit(0)
    return rank_model, reports


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
    try:
        store = dist.TCPStore("127.0.0.1", port, tp_size, is_master=False, timeout=DIST_TIMEOUT)
        tp = make_group(store, rank, tp_size, dev)
        config = ModelConfig.from_dir(Path(model_dir))
        rank_model = RankModel(Path(model_dir), config, tp, dtype, dev)
    except BaseException:
        reports.put(("error", rank, traceback.format_exc()))
        raise
    reports.put(("ready", rank, rank_model.load_report))
    follow(rank_model)


def follow(rank_model: RankModel) -> None:
    """Serve rank 0's commands until it says shut down."""
    tp = rank_model.model.tp
    comm = comm_device(rank_model.device)
    device = rank_model.device
    while True:
        header = tp.broadcast(torch.zeros(HEADER, dtype=torch.int64, device=comm))
        cmd, *args = (int(x) for x in header.cpu().tolist())
        if cmd == SHUTDOWN:
            return
        if cmd == ALLOCATE_KV:
            rank_model.allocate_kv_cache(args[0], args[1])
        elif cmd == PROFILE:
            rank_model.profile_peak_activation_bytes(args[0], args[1])
        elif cmd == EXECUTE:
            t, b, width, n_logits, block_size = args[:5]
            sizes = [t, t, b + 1, b, b * width, t, n_logits]
            flat = tp.broadcast(torch.empty(sum(sizes), dtype=torch.int64, device=comm))
            ids, pos, qsl, lens, tables, slots, idx = flat.to(device).split(sizes)
            meta = AttentionMetadata(qsl, lens, tables.view(b, width), slots, block_size)
            rank_model.execute(ids, pos, meta, idx)
        else:
            raise RuntimeError(f"unknown TP command {cmd}")
