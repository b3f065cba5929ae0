"""Install a checkpoint's tensors into a model built on the meta device, for one TP rank.

Each rank reads only its plan's slices. On CPU a slice that needs no cast and no re-layout is
used in place from the mapping (zero copy); others are copied once, several at a time. On CUDA
bytes go through pinned staging buffers with copies in flight on a side stream.
"""

from __future__ import annotations

import mmap
import resource
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from inference_svc.loader.checkpoint import Checkpoint
from inference_svc.loader.errors import MissingTensorError, UnexpectedTensorError
from inference_svc.loader.safetensors_mmap import SafetensorsFile
from inference_svc.loader.tp_plan import (
    Split,
    TensorPlan,
    TensorPlanError,
    checkpoint_name,
    plan_tensor,
)
from inference_svc.model.llama import CausalLM
from inference_svc.model.parallel import Loadable, usable_in_place

COPY_THREADS = 4


@dataclass(frozen=True)
class LoadReport:
    """What one rank's load cost."""

    rank: int
    tp_size: int
    num_tensors: int
    bytes_read: int  # bytes of this rank's slices: what it copied or uses in place
    bytes_in_place: int  # of those, used in place from the mapping (zero copy)
    checkpoint_bytes: int  # all weight bytes in the checkpoint
    seconds: float
    peak_rss_bytes: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def summary(self) -> str:
        return (
            f"rank {self.rank}/{self.tp_size}: {self.num_tensors} tensors, "
            f"{self.bytes_read / 1e6:.1f} MB of {self.checkpoint_bytes / 1e6:.1f} MB "
            f"({self.bytes_in_place / 1e6:.1f} MB in place) in {self.seconds * 1e3:.1f} ms, "
            f"{self.gb_per_s:.2f} GB/s, peak RSS {self.peak_rss_bytes / 2**20:.0f} MiB"
        )


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def plan_checkpoint(ckpt: Checkpoint, model: CausalLM) -> list[TensorPlan]:
    """Every checkpoint tensor's plan for this model's rank; missing/unknown tensors refused."""
    cfg, tp = model.config, model.tp
    plans: list[TensorPlan] = []
    for name in ckpt.names:
        info = ckpt.info(name)
        try:
            plan = plan_tensor(name, info.shape, cfg, tp.size, tp.rank)
        except TensorPlanError as e:
            raise UnexpectedTensorError(ckpt.file_of(name).path, str(e), name) from None
        if plan is not None:
            plans.append(plan)
    wanted = {n for n, _ in model.named_parameters()}
    if cfg.tie_word_embeddings:
        wanted.discard("lm_head.weight")
    missing = sorted(checkpoint_name(n) for n in wanted - {p.param for p in plans})
    if missing:
        raise MissingTensorError(
            ckpt.model_dir, f"{len(missing)} tensors missing from the checkpoint: {missing[:3]}"
        )
    return plans


def load_weights(
    model: CausalLM,
    ckpt: Checkpoint,
    device: torch.device | str = "cpu",
    plans: list[TensorPlan] | None = None,
    threads: int = COPY_THREADS,
) -> LoadReport:
    """Read this rank's slices into `model` (built on meta); returns what the load cost."""
    device = torch.device(device)
    t0 = time.perf_counter()
    plans = plan_checkpoint(ckpt, model) if plans is None else plans
    # Read in file order: sequential within each shard, so readahead helps on a cold cache.
    plans = sorted(plans, key=lambda p: (str(ckpt.file_of(p.name).path), ckpt.info(p.name).start))
    _advise(ckpt, plans)
    modules, params = dict(model.named_modules()), dict(model.named_parameters())
    jobs = [(p, ckpt.view(p.name)[p.index]) for p in plans]  # views: nothing read yet
    installs = [(_installer(modules, params, p), part) for p, part in jobs]
    if device.type == "cuda":
        _install_cuda(installs, device)
    else:
        _install_cpu(installs, [params[p.param] for p in plans], threads)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    installed = dict(model.named_parameters())
    bytes_read = sum(part.numel() * part.element_size() for _, part in jobs)
    in_place = sum(
        part.numel() * part.element_size()
        for p, part in jobs
        if part.numel() and installed[p.param].data_ptr() == part.data_ptr()
    )
    left = [n for n, prm in installed.items() if prm.is_meta]
    if left:
        raise MissingTensorError(ckpt.model_dir, f"weights never installed: {left[:3]}")
    return LoadReport(
        rank=model.tp.rank,
        tp_size=model.tp.size,
        num_tensors=len(jobs),
        bytes_read=bytes_read,
        bytes_in_place=in_place,
        checkpoint_bytes=ckpt.total_bytes,
        seconds=time.perf_counter() - t0,
        peak_rss_bytes=peak_rss_bytes(),
    )


def _advise(ckpt: Checkpoint, plans: list[TensorPlan]) -> None:
    """Tell the kernel which bytes this rank will read, so a cold read fetches just those.

    For a partial slice, read-around on page faults would drag in other ranks' bytes, so it is
    switched off for the tensor (MADV_RANDOM); a row slice (a piece of every row) is then faulted
    in page by page. Row-range slices and whole tensors are prefetched (MADV_WILLNEED), adjacent
    ranges merged: at TP=1 that is one call per file.
    """
    wanted: list[tuple[SafetensorsFile, int, int]] = []
    for plan in plans:
        f, info = ckpt.file_of(plan.name), ckpt.info(plan.name)
        if info.nbytes == 0:
            continue
        lo, hi = info.start, info.end
        if plan.dim is not None and plan.stop - plan.start < plan.shape[plan.dim]:
            _madvise(f, mmap.MADV_RANDOM, lo, hi)
            if plan.split is Split.ROW:
                continue
            row_bytes = info.nbytes // plan.shape[0]
            lo, hi = info.start + plan.start * row_bytes, info.start + plan.stop * row_bytes
        if wanted and wanted[-1][0] is f and lo <= wanted[-1][2] + mmap.PAGESIZE:
            wanted[-1] = (f, wanted[-1][1], max(hi, wanted[-1][2]))
        else:
            wanted.append((f, lo, hi))
    for f, lo, hi in wanted:
        _madvise(f, mmap.MADV_WILLNEED, lo, hi)


def _madvise(f: SafetensorsFile, advice: int, lo: int, hi: int) -> None:
    if hi > lo:
        aligned = lo - lo % mmap.PAGESIZE
        f.mapping().madvise(advice, aligned, hi - aligned)


Install = Callable[[torch.Tensor], None]


def _installer(
    modules: dict[str, nn.Module], params: dict[str, nn.Parameter], plan: TensorPlan
) -> Install:
    owner = modules[plan.module]
    if not isinstance(owner, Loadable):
        raise TypeError(f"{plan.module} has no weight_loader")
    param = params[plan.param]

    def install(loaded: torch.Tensor) -> None:
        owner.weight_loader(param, loaded, plan.shard_id)

    return install


def _install_cpu(
    installs: list[tuple[Install, torch.Tensor]], params: list[nn.Parameter], threads: int
) -> None:
    """Tensors used in place are installed at once; the copies run several at a time."""
    copies = []
    for (install, part), param in zip(installs, params, strict=True):
        if usable_in_place(param, part):
            install(part)
        else:
            copies.append((install, part))
    if len(copies) <= 1 or threads <= 1:
        for install, part in copies:
            install(part)
        return
    # torch copies release the GIL: several tensors are copied at once.
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for f in [pool.submit(install, part) for install, part in copies]:
            f.result()


def _install_cuda(
    installs: list[tuple[Install, torch.Tensor]], device: torch.device, in_flight: int = 4
) -> None:
    """mmap slice -> pinned buffer (CPU copy) -> GPU (async on a side stream), `in_flight` deep."""
    if not installs:
        return
    largest = max(part.numel() * part.element_size() for _, part in installs)
    buffers = [torch.empty(largest, dtype=torch.uint8).pin_memory() for _ in range(in_flight)]
    events: list[torch.cuda.Event | None] = [None] * in_flight
    stream = torch.cuda.Stream(device=device)
    for i, (install, part) in enumerate(installs):
        slot = i % in_flight
        ev = events[slot]
        if ev is not None:
            ev.synchronize()  # the copy that last used this buffer has landed
        nbytes = part.numel() * part.element_size()
        staged = buffers[slot][:nbytes].view(part.dtype).view(part.shape)
        staged.copy_(part)
        with torch.cuda.stream(stream):
            on_gpu = torch.empty(part.shape, dtype=part.dtype, device=device)
            on_gpu.copy_(staged, non_blocking=True)
            install(on_gpu)  # casts/pads on the same stream, if needed
            ev = torch.cuda.Event()
            ev.record(stream)
            events[slot] = ev
    stream.synchronize()
    torch.cuda.current_stream(device).wait_stream(stream)
