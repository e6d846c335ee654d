"""`python -m artsg_nb.tinker`: a local runtime behind the Tinker API, until Ctrl-C.

Starts the inference server (SGLang with a GPU, the CPU engine without) while a MultiTrainer
loads the same base model, then serves the Tinker routes on 127.0.0.1 and prints the two lines a
client needs:

    python -m artsg_nb.tinker --model HuggingFaceTB/SmolLM2-135M-Instruct --port 8765
    # base_url http://127.0.0.1:8765   api_key tml-...   (or pass --api-key tml-yours)
    python -m artsg_nb.tinker.rl_loop --base-url http://127.0.0.1:8765 --api-key tml-... \\
        --base-model HuggingFaceTB/SmolLM2-135M-Instruct --task addition_chat

Gradients are not clipped (Tinker's AdamParams.grad_clip_norm defaults to 0: none). SIGTERM or
Ctrl-C stops the API, the server (its process group) and the trainer; checkpoints stay under
--run-dir.

What it does not do: run GRPO experiments of its own (multi.Sweep does), or serve beyond
127.0.0.1 unless --host says so.
"""
from __future__ import annotations

import argparse
import logging
import math
import signal
import threading
from pathlib import Path

from ..models.pretrained import built_model_dir
from ..multi.trainer import LoraSpec, MultiTrainer
from ..serving.gpus import apply_to_kernel, list_gpus, plan_gpus, require_gpu
from ..serving.server import ServerConfig, start_server, start_while
from .server import TinkerServer
from .service import TinkerService


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m artsg_nb.tinker", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="base model (registered name, directory or hub id); "
                                                 "default: the offline tiny model")
    p.add_argument("--engine", default="auto", choices=("auto", "sglang", "cpu"),
                   help="inference engine; auto: SGLang with a GPU, the CPU engine without")
    p.add_argument("--rank", type=int, default=16, help="the largest LoRA rank a client may ask for")
    p.add_argument("--max-loras", type=int, default=8, help="adapters in one server batch")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765, help="0 picks a free one")
    p.add_argument("--api-key", default=None, help='the key clients send ("tml-..."); default: a random one')
    p.add_argument("--run-dir", default="runs/tinker", help="the server's log and every saved checkpoint")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per engine request otherwise
    plan = plan_gpus(list_gpus())
    engine = args.engine if args.engine != "auto" else ("cpu" if plan.mode == "cpu" else "sglang")
    if engine != "cpu" and plan.mode == "cpu":
        require_gpu()
    apply_to_kernel(plan)
    model_dir = built_model_dir(args.model)
    run_dir, lora = Path(args.run_dir), LoraSpec(rank=args.rank)
    server_cfg = ServerConfig(engine=engine, model_path=model_dir, run_dir=str(run_dir / "server"),
                              max_lora_rank=lora.rank, lora_target_modules=lora.target_modules,
                              max_loras_per_batch=args.max_loras, gpu_plan=plan,
                              mem_fraction=getattr(plan, "server_mem_fraction", None))
    server, trainer = start_while(lambda: start_server(server_cfg),
                                  lambda: MultiTrainer(model_dir, lora, max_grad_norm=math.inf))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        service = TinkerService(trainer, server.client(), base_model=model_dir, root=run_dir / "checkpoints",
                                aliases=tuple(a for a in (args.model,) if a))
        with TinkerServer(service, host=args.host, port=args.port, api_key=args.api_key) as api:
            print(f"Tinker API: base_url {api.base_url}   api_key {api.api_key}   base_model {model_dir}", flush=True)
            try:
                stop.wait()
            except KeyboardInterrupt:
                pass
    finally:
        server.stop()
        trainer.close()


if __name__ == "__main__":
    main()
