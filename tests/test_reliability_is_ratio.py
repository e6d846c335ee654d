"""What the history's importance-sampling columns mean (a pipelined step's raw ratio can be far
above the cap; before, the history's is_ratio_* were the raw ratio under grpo's names for the
weight applied, e.g. max 8.25 while the weight was capped at 3).

A trainer with is_mode="token_truncate" (is_clip_max = 3) trains on rollouts whose sampling
logprobs are 3 nats below the trainer's (raw ratio e^3 ≈ 20 on every token): is_ratio_* are
grpo's weights (max ≤ 3) and is_raw_ratio_* the raw ratio (≈ 20), in the metrics and the row.
"""
from __future__ import annotations

import math

from artsg_nb.rl.grpo import GRPOConfig
from artsg_nb.run.row import step_row
from artsg_nb.rl.trainer import Trainer, TrainerConfig
from test_distributed import _groups


def test_history_records_the_capped_weight_and_the_raw_ratio_apart(tiny_model_dir):
    cfg = TrainerConfig(model_path=str(tiny_model_dir), lora_rank=4, lora_alpha=8, seed=0, micro_batch_tokens=16,
                        grpo=GRPOConfig(is_mode="token_truncate", is_clip_max=3.0))
    trainer = Trainer(cfg)
    groups = _groups()
    for g in groups:
        for t in g.trajectories:
            lps = trainer.score_tokens(t.token_ids)
            t.logprobs = [0.0] + [lp - 3.0 if m else 0.0 for lp, m in zip(lps, t.completion_mask[1:])]
    metrics = trainer.train_step(groups)
    row = step_row(1, "policy-step-1", [], metrics).as_dict()
    assert row["is_ratio_max"] <= 3.0 + 1e-6 and row["is_ratio_min"] <= row["is_ratio_mean"] <= 3.0 + 1e-6
    assert row["is_raw_ratio_min"] > 15 and math.isclose(row["is_raw_ratio_mean"], math.exp(3), rel_tol=0.1)
