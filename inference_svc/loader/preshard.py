"""Pre-sharded checkpoints: one safetensors file per TP rank, written once, read sequentially.

Layout: `preshard.json` (format, TP size, source revision), the source's small files (config,
tokenizer, generation config) and `rank-K/model.safetensors` holding exactly rank K's slices
under their checkpoint names. Loading with another TP size is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

import torch

from inference_svc.loader.checkpoint import INDEX_NAME, PICKLE_SUFFIXES, Checkpoint
from inference_svc.loader.errors import PreshardError
from inference_svc.loader.safetensors_mmap import DTYPE_NAMES
from inference_svc.loader.tp_plan import TensorPlan, TensorPlanError, plan_tensor
from inference_svc.model.config import ModelConfig
from inference_svc.model.llama import CausalLM

MANIFEST = "preshard.json"
FORMAT = "inference-svc-preshard/1"
_HEX40 = re.compile(r"[0-9a-f]{40}")


def is_presharded(model_dir: str | Path) -> bool:
    return (Path(model_dir) / MANIFEST).is_file()


def source_revision(model_dir: Path) -> str:
    """The commit of a hub-cache snapshot directory, else a digest of config + tensor headers."""
    name = model_dir.absolute().name  # not resolve(): the snapshot dir itself names the commit
    if _HEX40.fullmatch(name):
        return name
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in Checkpoint(model_dir).files:
        with open(f.path, "rb") as fh:
            h.update(fh.read(f.header.data_start))
    return "sha256:" + h.hexdigest()


def read_manifest(model_dir: str | Path) -> dict[str, object]:
    path = Path(model_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PreshardError(path, f"unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PreshardError(path, f"not a {FORMAT} manifest")
    if not isinstance(manifest.get("tp_size"), int) or not isinstance(manifest.get("ranks"), list):
        raise PreshardError(path, "manifest needs an integer tp_size and a list of ranks")
    ranks = manifest["ranks"]
    if len(ranks) != manifest["tp_size"] or not all(
        isinstance(r, str) and r not in ("", ".", "..") and Path(r).name == r for r in ranks
    ):
        # Each rank names a directory inside this one: never a path out of it.
        raise PreshardError(path, f"ranks {ranks!r} are not tp_size plain directory names")
    return manifest


def open_presharded(model_dir: Path, model: CausalLM) -> tuple[Checkpoint, list[TensorPlan]]:
    """This rank's file and plans that read each of its tensors whole, in file order."""
    manifest = read_manifest(model_dir)
    tp = model.tp
    if manifest["tp_size"] != tp.size:
        raise PreshardError(
            model_dir / MANIFEST,
            f"written for TP={manifest['tp_size']}, cannot load with TP={tp.size}; "
            "pre-shard again or load the original checkpoint",
        )
    ranks = manifest["ranks"]
    assert isinstance(ranks, list)
    rank_dir = model_dir / str(ranks[tp.rank])
    ckpt = Checkpoint(rank_dir)
    try:
        full_shapes = json.loads(ckpt.files[0].metadata.get("full_shapes", "{}"))
    except json.JSONDecodeError as e:
        raise PreshardError(ckpt.files[0].path, f"full_shapes is not JSON ({e})") from None
    if not isinstance(full_shapes, dict):
        raise PreshardError(ckpt.files[0].path, "full_shapes must map tensor names to shapes")
    plans = []
    for name in ckpt.names:
        info = ckpt.info(name)
        full = full_shapes.get(name)
        if not isinstance(full, list) or not all(isinstance(d, int) for d in full):
            raise PreshardError(ckpt.file_of(name).path, "no full shape recorded", name)
        try:
            plan = plan_tensor(name, tuple(full), model.config, tp.size, tp.rank)
        except TensorPlanError as e:
            raise PreshardError(ckpt.file_of(name).path, str(e), name) from None
        if plan is None:
            continue
        if info.shape != plan.slice_shape:
            raise PreshardError(
                ckpt.file_of(name).path,
                f"holds {list(info.shape)}, rank {tp.rank} needs {list(plan.slice_shape)}",
                name,
            )
        if plan.dim is not None:  # the file holds just the slice: read it whole
            plan = dataclasses.replace(plan, shape=info.shape, start=0, stop=info.shape[plan.dim])
        plans.append(plan)
    missing = {n for n, _ in model.named_parameters()} - {p.param for p in plans}
    if model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise PreshardError(rank_dir, f"weights missing: {sorted(missing)[:3]}")
    return ckpt, plans


def write_presharded(
    model_dir: Path, tp_size: int, out_dir: Path, revision: str | None = None
) -> Path:
    """Write `model_dir` as TP=`tp_size` pre-sharded files into `out_dir` (atomically)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    cfg = ModelConfig.from_dir(model_dir)
    cfg.check_tp(tp_size)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists")
    ckpt = Checkpoint(model_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for src in sorted(model_dir.iterdir()):
            weights = src.suffix == ".safetensors" or src.suffix in PICKLE_SUFFIXES
            if src.is_file() and not weights and src.name not in (INDEX_NAME, MANIFEST):
                shutil.copy2(src, tmp / src.name)
        ranks = []
        for rank in range(tp_size):
            name = f"rank-{rank}"
            (tmp / name).mkdir()
            _write_rank(ckpt, cfg, tp_size, rank, tmp / name / "model.safetensors")
            ranks.append(name)
        manifest = {
            "format": FORMAT,
            "tp_size": tp_size,
            "source_revision": revision or source_revision(model_dir),
            "architecture": cfg.architecture,
            "ranks": ranks,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        tmp.chmod(0o755)
        os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _write_rank(ckpt: Checkpoint, cfg: ModelConfig, tp: int, rank: int, path: Path) -> None:
    """Stream one rank's slices into a safetensors file: header first, then each slice's bytes."""
    plans = []
    for name in ckpt.names:
        plan = plan_tensor(name, ckpt.info(name).shape, cfg, tp, rank)
        if plan is not None:
            plans.append(plan)
    header: dict[str, object] = {
        "__metadata__": {
            "format": "pt",
            "tp_size": str(tp),
            "rank": str(rank),
            "full_shapes": json.dumps({p.name: list(p.shape) for p in plans}),
        }
    }
    offset = 0
    for p in plans:
        dtype = ckpt.info(p.name).dtype
        n = p.nbytes(dtype.itemsize)
        header[p.name] = {
            "dtype": DTYPE_NAMES[dtype],
            "shape": list(p.slice_shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data region 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for p in plans:
            part = ckpt.view(p.name)[p.index].contiguous()
            if part.numel():
                f.write(part.view(torch.uint8).reshape(-1).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
