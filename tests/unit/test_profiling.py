"""--use_profiler: torch.profiler traces per rank with llama-cookbook's schedule (wait 1, warm-up 2, record 3)."""

from __future__ import annotations

import json

import torch

from shardtune.config.flags import config_from
from shardtune.runtime.distributed import DistEnv
from shardtune.training.engine.profiling import StepProbe

CPU = torch.device("cpu")


def test_the_profiler_records_steps_4_to_6_of_each_rank_as_a_chrome_trace(tmp_path):
    layer = torch.nn.Linear(32, 32)
    cfg = config_from(output_dir=str(tmp_path / "run"), use_profiler=True, profiler_dir=str(tmp_path / "traces"))
    for rank in (0, 1):  # what each rank of a run does (the traces are per process; no collective is involved)
        env = DistEnv(rank=rank, local_rank=rank, world_size=2, local_world_size=2, device=CPU, backend="gloo")
        probe = StepProbe(cfg, env, total_steps=8)
        for step in range(1, 9):
            with probe.step(step):
                layer(torch.randn(8, 32)).sum().backward()
        probe.close()
    for rank in (0, 1):
        (trace,) = (tmp_path / "traces").glob(f"rank{rank}.*.pt.trace.json")
        events = json.loads(trace.read_text())["traceEvents"]
        steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
        assert steps == ["ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"]  # torch counts from 0: steps 4-6
        assert any(e.get("name") == "aten::mm" for e in events)
