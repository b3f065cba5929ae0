"""Loading weights: zero copy where possible, and each TP rank reading about 1/TP of the bytes,
measured twice: by the loader's own count and by the page cache (mincore after a cold drop)."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from inference_svc.loader.checkpoint import Checkpoint
from inference_svc.loader.errors import MissingTensorError, UnexpectedTensorError
from inference_svc.loader.tp_plan import Split, expected_shape, plan_tensor
from inference_svc.loader.weights import load_weights
from inference_svc.model.config import ModelConfig
from inference_svc.model.llama import CausalLM
from inference_svc.model.parallel import TPGroup
from inference_svc.testing.models import ModelSpec, cached_model

PAGE = mmap.PAGESIZE
WIDE = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 1024,
    "intermediate_size": 8192,  # down_proj rows of 32 KiB: half a row spans whole pages
    "num_hidden_layers": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 512,
    "dtype": "float32",
}
SUFFIXES = [
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
]  # fmt: skip


def write_checkpoint(model_dir: Path, raw_config: dict[str, object], files: int = 2) -> None:
    """A checkpoint of constant-valued tensors (this test is about bytes, not values)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(raw_config))
    cfg = ModelConfig.from_dict(raw_config)
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
        "model.norm.weight": (cfg.hidden_size,),
        "lm_head.weight": (cfg.vocab_size, cfg.hidden_size),
    }
    for s in SUFFIXES:
        shapes[f"model.layers.0.{s}"] = expected_shape(s, cfg) or ()
    names = list(shapes)
    for i in range(files):
        part = {n: torch.full(shapes[n], 0.5) for n in names[i::files]}
        path = model_dir / f"model-{i}.safetensors"
        save_file(part, str(path))
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def drop_pages(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(path: Path) -> int:
    """Bytes of the file in the page cache (mincore on a fresh mapping touches nothing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    vec = (ctypes.c_ubyte * (-(-size // PAGE)))()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = np.frombuffer(mm, dtype=np.uint8)
        rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
        del view  # release the buffer export before the mapping closes
    if rc != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec) * PAGE


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("wide")
    write_checkpoint(d, WIDE)
    return d


def page_bound(ckpt: Checkpoint, cfg: ModelConfig, rank: int, tp: int) -> int:
    """Most bytes the page cache may hold after this rank's reads: page rounding and a
    read-around window per contiguous slice, a page per row piece for strided slices."""
    total = 0
    for name in ckpt.names:
        info = ckpt.info(name)
        plan = plan_tensor(name, info.shape, cfg, tp, rank)
        assert plan is not None
        n = plan.nbytes(info.dtype.itemsize)
        if plan.split is Split.ROW:
            piece = (plan.stop - plan.start) * info.dtype.itemsize
            total += min(plan.shape[0] * (-(-piece // PAGE) + 1) * PAGE, info.nbytes + PAGE)
        else:
            total += n + 2 * PAGE + 256 * 1024
    return total + 2 * PAGE * len(ckpt.files)  # headers


def test_each_rank_reads_about_a_half_at_tp2_measured(wide_dir: Path) -> None:
    cfg = ModelConfig.from_dir(wide_dir)
    files = sorted(wide_dir.glob("*.safetensors"))
    ckpt = Checkpoint(wide_dir)
    replicated = sum(ckpt.info(n).nbytes for n in ckpt.names if n.endswith("norm.weight"))
    shardable = ckpt.total_bytes - replicated
    for rank in range(2):
        drop_pages(files)
        if sum(resident_bytes(p) for p in files) > 2 * PAGE * len(files):
            pytest.skip("this filesystem keeps pages cached despite POSIX_FADV_DONTNEED")
        model = CausalLM(cfg, TPGroup(rank, 2), torch.float32)
        report = load_weights(model, Checkpoint(wide_dir))
        # Use every weight: in-place ones are only read now.
        checksum = sum(float(p.double().sum()) for p in model.parameters())
        assert checksum == pytest.approx(0.5 * sum(p.numel() for p in model.parameters()))
        # The loader's count: exactly half of every split tensor plus the replicated norms.
        assert report.bytes_read == replicated + shardable // 2
        # The page cache's count: at least what was read, at most that rounded to pages.
        resident = sum(resident_bytes(p) for p in files)
        assert report.bytes_read <= resident <= page_bound(ckpt, cfg, rank, 2), rank
        assert resident <= 0.6 * ckpt.total_bytes
        del model


def test_tp1_uses_every_tensor_in_place(wide_dir: Path) -> None:
    cfg = ModelConfig.from_dir(wide_dir)
    model = CausalLM(cfg, TPGroup(), torch.float32)
    report = load_weights(model, Checkpoint(wide_dir))
    assert report.bytes_in_place == report.bytes_read == report.checkpoint_bytes
    assert report.gb_per_s > 0 and "rank 0/1" in report.summary()


def test_tp2_column_slices_stay_in_place_row_slices_are_copied(wide_dir: Path) -> None:
    cfg = ModelConfig.from_dir(wide_dir)
    model = CausalLM(cfg, TPGroup(1, 2), torch.float32)
    ckpt = Checkpoint(wide_dir)
    load_weights(model, ckpt)
    q = model.get_parameter("model.layers.0.self_attn.qkv_proj.weight.q")
    down = model.get_parameter("model.layers.0.mlp.down_proj.weight")
    full_q = ckpt.view("model.layers.0.self_attn.q_proj.weight")
    assert q.data_ptr() == full_q[512:].data_ptr()  # rows 512.. of the mapping, no copy
    assert down.is_contiguous() and down.shape == (1024, 4096)
    # q shares the storage of the whole mapped tensor; down owns a buffer of exactly its size.
    assert q.untyped_storage().nbytes() == full_q.nbytes
    assert down.untyped_storage().nbytes() == down.nbytes == full_q.nbytes * 4


def test_missing_and_unexpected_tensors_are_refused(tmp_path: Path) -> None:
    model_dir = cached_model(ModelSpec(family="llama"))
    cfg = ModelConfig.from_dir(model_dir)
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    (ckpt_dir / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    src = Checkpoint(model_dir)
    tensors = {n: src.view(n).clone() for n in src.names}
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, str(ckpt_dir / "model.safetensors"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_weights(CausalLM(cfg, TPGroup(), torch.float32), Checkpoint(ckpt_dir))
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(ckpt_dir / "model.safetensors"))
    with pytest.raises(UnexpectedTensorError, match=r"up_proj.*shape \[3, 3\]"):
        load_weights(CausalLM(cfg, TPGroup(), torch.float32), Checkpoint(ckpt_dir))


def mapped_file(address: int) -> str | None:
    """The file backing `address` in this process, from /proc/self/maps (None: anonymous)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return fields[5] if len(fields) == 6 and fields[5].startswith("/") else None
    return None


def test_in_place_weights_live_in_the_file_mapping_and_cast_ones_do_not(wide_dir: Path) -> None:
    cfg = ModelConfig.from_dir(wide_dir)
    files = {str(p) for p in wide_dir.glob("*.safetensors")}
    in_place = CausalLM(cfg, TPGroup(), torch.float32)
    load_weights(in_place, Checkpoint(wide_dir))
    for name, p in in_place.named_parameters():
        assert mapped_file(p.data_ptr()) in files, name
    cast = CausalLM(cfg, TPGroup(), torch.bfloat16)
    load_weights(cast, Checkpoint(wide_dir))
    for name, p in cast.named_parameters():
        assert mapped_file(p.data_ptr()) not in files, name
