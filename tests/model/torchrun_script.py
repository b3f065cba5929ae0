"""Run under `torchrun --nproc-per-node 2`: every rank calls create_executor; rank 0 writes the
logits of one prefill as JSON to argv[2] (the other rank follows, then exits in create_executor)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from inference_svc.model.attention import AttentionMetadata
from inference_svc.model.executor import create_executor

PROMPT = [0, 17, 42, 300, 5, 9, 88, 123, 7]


def main() -> None:
    ex = create_executor(Path(sys.argv[1]), tensor_parallel_size=2)
    ex.allocate_kv_cache(8, 4)
    meta = AttentionMetadata.for_prefill([len(PROMPT)], 4)
    logits = ex.execute(torch.tensor(PROMPT), torch.arange(len(PROMPT)), meta, torch.arange(9))
    reports = [r.bytes_read for r in ex.load_reports]
    ex.shutdown()
    result = {"logits": logits.tolist(), "bytes": reports, "group_left": dist.is_initialized()}
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
