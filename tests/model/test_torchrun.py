"""The executor under `torchrun`: two ranks started by torchrun, not by the service."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from inference_svc.model.attention import AttentionMetadata
from inference_svc.model.executor import create_executor
from inference_svc.testing.models import ModelSpec, cached_model

from .torchrun_script import PROMPT

SCRIPT = Path(__file__).with_name("torchrun_script.py")


def test_torchrun_two_ranks_equal_tp1(tmp_path: Path) -> None:
    model_dir = cached_model(ModelSpec(family="qwen2", num_key_value_heads=1, vocab_size=515))
    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPT), str(model_dir), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["group_left"] is False  # shutdown destroyed rank 0's process group too
    got = torch.tensor(result["logits"])
    ex = create_executor(model_dir)
    ex.allocate_kv_cache(8, 4)
    meta = AttentionMetadata.for_prefill([len(PROMPT)], 4)
    want = ex.execute(torch.tensor(PROMPT), torch.arange(len(PROMPT)), meta, torch.arange(9))
    ex.shutdown()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(result["bytes"]) == 2 and sum(result["bytes"]) < 1.3 * ex.load_reports[0].bytes_read
