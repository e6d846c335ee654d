"""Where a GRPO step's reload time goes: save, checksum, fsync, load, first request.

    python benchmarks/reload_profile.py --model DIR [--engine cpu|sglang] [--dirs runs/reload /dev/shm/reload]

For each adapters directory (a disk-backed one and a RAM-backed one, e.g. /dev/shm, to measure
issue 17's "RAM-backed directory"), it computes no loss: it takes an AdamW step of a real
Trainer on random gradients (so every version differs and the optimizer state has its real
size), then times what AdapterVersions.publish (run/versions.py) does for one
version — the adapter file (PEFT save), the sha256 of the adapter, the fsyncs and rename
(lora.save_adapter_atomic), the copy of the optimizer state handed to the background writer
(snapshot_s), the server's load, and the first request under the new adapter — `--repeats`
times, and prints the medians per directory. Off the critical path, beside them: how long the
background write of the checkpoint still ran after the first request (checkpoint_left_s: 0 when
it was hidden), and what writing it synchronously costs (checkpoint_sync_s, what every reload
paid before 8ed7280). Output: a table, and with `--out` a CSV.

What it does not do: GRPO (no rollouts, no loss), or SGLang's load-from-tensors route.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import time
from datetime import datetime
from pathlib import Path

import pandas as pd
import torch

from artsg_nb.bench.run import hardware_name
from artsg_nb.engines import SamplingParams
from artsg_nb.rl.checkpoint import write_checkpoint
from artsg_nb.rl.lora import AdapterPublisher, file_sha256, save_adapter_atomic
from artsg_nb.serving.server import ServerConfig, start_server
from artsg_nb.rl.trainer import Trainer, TrainerConfig


class Timed:
    """Wraps the pieces of one save so their seconds can be read back."""

    def __init__(self, trainer: Trainer):
        self.trainer, self.t = trainer, {}

    def save(self, tmp: Path) -> None:
        """What save_adapter_atomic runs before the rename in a step: the adapter only."""
        t0 = time.perf_counter()
        self.trainer.save_adapter(tmp)
        t1 = time.perf_counter()
        file_sha256(tmp / "adapter_model.safetensors")
        self.t.update(adapter_s=t1 - t0, sha256_s=time.perf_counter() - t1)


async def profile_dir(trainer: Trainer, server, adapters: Path, repeats: int, prompt_ids: list[int]) -> list[dict]:
    run_dir = adapters.parent
    client = server.client()
    publisher = AdapterPublisher(client, run_dir)
    timed = Timed(trainer)
    scratch = adapters.parent / "checkpoint-sync"
    scratch.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for step in range(1, repeats + 2):
            for p in trainer.model.parameters():  # an optimizer step on random gradients: AdamW's
                if p.requires_grad:                 # state (2 tensors per weight) is saved as in a run
                    p.grad = torch.randn_like(p) * 1e-3
            trainer.optimizer_step()
            trainer.step = step
            t0 = time.perf_counter()
            version = save_adapter_atomic(timed.save, adapters, step)
            renamed = time.perf_counter()
            trainer.save_checkpoint(version.path, wait=False)  # as AdapterVersions.write
            save_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            await publisher.publish(version)
            load_s = time.perf_counter() - t1
            t2 = time.perf_counter()
            await client.generate(prompt_ids, SamplingParams(max_new_tokens=1, temperature=0.0), adapter=version.name)
            first_s = time.perf_counter() - t2
            t3 = time.perf_counter()
            trainer.wait_for_checkpoint()
            left_s = time.perf_counter() - t3
            t4 = time.perf_counter()
            write_checkpoint(trainer.checkpoint_snapshot(), scratch)
            sync_s = time.perf_counter() - t4
            if step > 1:  # the first load warms the server's adapter path
                rows.append({"dir": str(adapters), **timed.t, "fsync_rename_s": renamed - t0 - sum(timed.t.values()),
                             "snapshot_s": save_s - (renamed - t0), "save_total_s": save_s, "load_s": load_s,
                             "first_request_s": first_s, "reload_s": save_s + load_s + first_s,
                             "checkpoint_left_s": left_s, "checkpoint_sync_s": sync_s})
    finally:
        trainer.wait_for_checkpoint()
        await client.aclose()
    return rows


def main(argv=None) -> pd.DataFrame:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--engine", default="cpu")
    p.add_argument("--dirs", nargs="+", default=["runs/reload-profile", "/dev/shm/artsg-reload-profile"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--out")
    a = p.parse_args(argv)
    trainer = Trainer(TrainerConfig(model_path=a.model, lora_rank=a.lora_rank, lora_alpha=2 * a.lora_rank))
    prompt_ids = trainer.tokenizer("What is 2 + 3?")["input_ids"]
    rows = []
    for d in map(Path, a.dirs):
        shutil.rmtree(d, ignore_errors=True)
        server = start_server(ServerConfig(engine=a.engine, model_path=a.model, run_dir=str(d),
                                           max_lora_rank=a.lora_rank))
        try:
            rows += asyncio.run(profile_dir(trainer, server, d / "adapters", a.repeats, prompt_ids))
        finally:
            server.stop()
            shutil.rmtree(d, ignore_errors=True)
    df = pd.DataFrame(rows)
    size = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    print(f"model {Path(a.model).name}, LoRA r{a.lora_rank}: {size / 1e6:.2f} M trainable parameters, "
          f"engine {a.engine}, {os.cpu_count()} CPUs; medians of {a.repeats}:")
    med = df.groupby("dir", sort=False).median(numeric_only=True)
    print(med.round(4).to_string())
    if a.out:
        med.assign(model=Path(a.model).name, lora_rank=a.lora_rank, engine=a.engine, repeats=a.repeats,
                   hardware=hardware_name(a.engine), date=f"{datetime.now():%Y-%m-%d}").to_csv(a.out)
    return med


if __name__ == "__main__":
    main()
