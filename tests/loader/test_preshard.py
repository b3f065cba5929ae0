"""Pre-sharded checkpoints: the CLI writes one set per rank; loading them equals the normal load;
another TP size is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference_svc.cli import main
from inference_svc.loader.checkpoint import Checkpoint
from inference_svc.loader.errors import PreshardError
from inference_svc.loader.preshard import MANIFEST, open_presharded, source_revision
from inference_svc.loader.tokenizer import load_tokenizer
from inference_svc.loader.weights import load_weights
from inference_svc.model.attention import AttentionMetadata
from inference_svc.model.config import ModelConfig
from inference_svc.model.executor import create_executor
from inference_svc.model.llama import CausalLM
from inference_svc.model.parallel import TPGroup
from inference_svc.testing.models import ModelSpec, cached_model

SPEC = ModelSpec(family="qwen2", num_key_value_heads=1, vocab_size=515)


@pytest.fixture(scope="module")
def presharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    src = cached_model(SPEC)
    out = tmp_path_factory.mktemp("pre") / "tp2"
    assert main(["preshard", str(src), "--tp", "2", "--out", str(out)]) == 0
    return src, out


def test_layout_and_manifest(presharded: tuple[Path, Path]) -> None:
    src, out = presharded
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["tp_size"] == 2 and manifest["ranks"] == ["rank-0", "rank-1"]
    assert manifest["source_revision"] == source_revision(src)
    assert manifest["source_revision"].startswith("sha256:")
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert load_tokenizer(out).encode("hello") == load_tokenizer(src).encode("hello")
    assert not list(out.glob("*.safetensors"))
    # Each rank's file holds about half the bytes (embedding/lm_head tails aside).
    total = Checkpoint(src).total_bytes
    for rank in range(2):
        assert 0.3 * total < Checkpoint(out / f"rank-{rank}").total_bytes < 0.7 * total


@pytest.mark.parametrize("rank", [0, 1])
def test_presharded_weights_equal_the_normal_load(presharded: tuple[Path, Path], rank: int) -> None:
    src, out = presharded
    cfg = ModelConfig.from_dir(src)
    normal = CausalLM(cfg, TPGroup(rank, 2), torch.float32)
    load_weights(normal, Checkpoint(src))
    pre = CausalLM(cfg, TPGroup(rank, 2), torch.float32)
    ckpt, plans = open_presharded(out, pre)
    report = load_weights(pre, ckpt, plans=plans)
    assert report.bytes_read == ckpt.total_bytes  # every byte of its own file, nothing else
    a, b = dict(normal.named_parameters()), dict(pre.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_presharded_executor_equals_the_normal_one(presharded: tuple[Path, Path]) -> None:
    src, out = presharded
    ids = torch.tensor([0, 5, 9, 300, 514, 2])
    meta = AttentionMetadata.for_prefill([6], 4)
    outs = []
    for model_dir, tp in ((src, 1), (out, 2)):
        ex = create_executor(model_dir, tensor_parallel_size=tp)
        try:
            ex.allocate_kv_cache(8, 4)
            outs.append(ex.execute(ids, torch.arange(6), meta, torch.arange(6)))
        finally:
            ex.shutdown()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_other_tp_size_is_refused(presharded: tuple[Path, Path]) -> None:
    _, out = presharded
    cfg = ModelConfig.from_dir(out)
    with pytest.raises(PreshardError, match="written for TP=2, cannot load with TP=1"):
        open_presharded(out, CausalLM(cfg, TPGroup(), torch.float32))
    with pytest.raises(PreshardError, match="TP=2"):
        create_executor(out, tensor_parallel_size=1)


def test_cli_refuses_existing_output_and_bad_tp(
    presharded: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    src, out = presharded
    assert main(["preshard", str(src), "--tp", "2", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["preshard", str(src), "--tp", "3", "--out", str(out.parent / "x")]) == 2
    assert "TP=3" in capsys.readouterr().err
    assert not (out.parent / "x").exists()


def test_revision_is_the_snapshot_commit_when_there_is_one(tmp_path: Path) -> None:
    src = cached_model(SPEC)
    snap = tmp_path / "snapshots" / ("ab" * 20)
    snap.parent.mkdir()
    snap.symlink_to(src)
    out = tmp_path / "out"
    assert main(["preshard", str(snap), "--tp", "1", "--out", str(out)]) == 0
    assert json.loads((out / MANIFEST).read_text())["source_revision"] == "ab" * 20


@pytest.mark.parametrize(
    "ranks", [["rank-0"], ["rank-0", "../rank-1"], ["rank-0", "/tmp"], ["rank-0", 1]]
)
def test_manifest_ranks_must_name_tp_size_directories_inside_it(
    presharded: tuple[Path, Path], tmp_path: Path, ranks: list[object]
) -> None:
    _, out = presharded
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    manifest = json.loads((bad / MANIFEST).read_text())
    (bad / MANIFEST).write_text(json.dumps({**manifest, "ranks": ranks}))
    cfg = ModelConfig.from_dir(bad)
    with pytest.raises(PreshardError, match="plain directory names"):
        open_presharded(bad, CausalLM(cfg, TPGroup(1, 2), torch.float32))


@pytest.mark.parametrize("full_shapes", ["not json", "[1, 2]", '{"model.norm.weight": "64"}'])
def test_malformed_full_shapes_are_a_preshard_error(
    presharded: tuple[Path, Path], tmp_path: Path, full_shapes: str
) -> None:
    _, out = presharded
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    rank_file = bad / "rank-0" / "model.safetensors"
    tensors = load_file(rank_file)
    metadata = Checkpoint(bad / "rank-0").files[0].metadata
    save_file(tensors, rank_file, metadata={**metadata, "full_shapes": full_shapes})
    cfg = ModelConfig.from_dir(bad)
    with pytest.raises(PreshardError, match=r"full_shapes|full shape"):
        open_presharded(bad, CausalLM(cfg, TPGroup(0, 2), torch.float32))
