"""tinker-cookbook's RL loop (recipes/rl_loop.py), small: only the `tinker` client talks to the server.

Each step: save the adapter for sampling and get a sampling client; sample `group_size` replies
to each of `groups` prompts of an artsg_nb task; reward them; advantage = reward - group mean
(groups whose rewards are all equal are skipped); one forward_backward with loss_fn
"importance_sampling" on every reply's tokens (the sampler's logprobs as the old policy) and one
optim_step (AdamParams). The datums are built exactly as the cookbook builds them.

    python -m artsg_nb.tinker.rl_loop --base-url http://127.0.0.1:8765 --api-key tml-... \\
        --base-model PATH [--steps 12 --groups 8 --group-size 8 --learning-rate 3e-3]

What it does not do: start anything (python -m artsg_nb.tinker serves the runtime), or import
torch or artsg_nb's trainer: it is what a Tinker user runs, with an artsg_nb task for the reward.
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import random
import time
from dataclasses import MISSING, asdict, dataclass, fields

from ..tasks.registry import get_task


@dataclass
class LoopConfig:
    """The loop's knobs (the cookbook's Config, with an artsg_nb task instead of GSM8K)."""

    base_url: str
    """The Tinker server, e.g. "http://127.0.0.1:8765"."""
    api_key: str
    """The server's key ("tml-..."; the client refuses keys without that prefix)."""
    base_model: str
    """The served base model (its path, or a name the server accepts)."""
    task: str = "addition"
    """artsg_nb task whose episodes give prompts and rewards (single turn)."""
    steps: int = 12
    """Training steps."""
    groups: int = 8
    """Prompts per step."""
    group_size: int = 8
    """Replies sampled per prompt."""
    learning_rate: float = 3e-3
    """AdamW learning rate of every optim_step."""
    lora_rank: int = 8
    """LoRA rank of the training client."""
    seed: int = 0
    """Seeds the prompts and the adapter's initialisation."""


def _reward(env, reply: str) -> float:
    result = env.step(reply)
    if inspect.isawaitable(result):
        result = asyncio.run(result)
    return float(result.reward or 0.0)


def _prompt_tokens(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _datum(types, tokens: list[int], ob_len: int, logprobs: list[float], advantage: float):
    """The cookbook's datum: input tokens[:-1], targets tokens[1:], the sampler's logprobs and the
    advantage on the reply's positions, zeros on the prompt's."""
    input_tokens = tokens[:-1]
    return types.Datum(model_input=types.ModelInput.from_ints(input_tokens),
                       loss_fn_inputs={"target_tokens": tokens[1:],
                                       "logprobs": [0.0] * ob_len + list(logprobs),
                                       "advantages": [0.0] * ob_len + [advantage] * (len(input_tokens) - ob_len)})


def run(cfg: LoopConfig) -> list[dict]:
    """The loop; one row per step (step, reward, datums, loss, seconds), also printed."""
    import tinker
    from tinker import types

    task, rng = get_task(cfg.task), random.Random(cfg.seed)
    service = tinker.ServiceClient(base_url=cfg.base_url, api_key=cfg.api_key)
    try:
        training = service.create_lora_training_client(base_model=cfg.base_model, rank=cfg.lora_rank,
                                                       seed=cfg.seed).result()
        tokenizer = training.get_tokenizer()
        params = types.SamplingParams(max_tokens=task.max_new_tokens, stop=[tokenizer.eos_token_id])
        adam = types.AdamParams(learning_rate=cfg.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8)
        rows = []
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            sampler = training.save_weights_and_get_sampling_client().result()
            seeds = [rng.randrange(1 << 30) for _ in range(cfg.groups)]
            prompts = [_prompt_tokens(tokenizer, task.make_env(s).reset()) for s in seeds]
            futures = [[sampler.sample(types.ModelInput.from_ints(p), 1, params) for _ in range(cfg.group_size)]
                       for p in prompts]
            datums, rewards = [], []
            for seed, prompt, group in zip(seeds, prompts, futures):
                seqs = [f.result().sequences[0] for f in group]
                group_rewards = [_reward(task.make_env(seed), tokenizer.decode(s.tokens, skip_special_tokens=True))
                                 for s in seqs]
                rewards.extend(group_rewards)
                mean = sum(group_rewards) / len(group_rewards)
                if all(r == mean for r in group_rewards):
                    continue  # no signal in this group
                datums += [_datum(types, prompt + s.tokens, len(prompt) - 1, s.logprobs, r - mean)
                           for s, r in zip(seqs, group_rewards)]
            loss = None
            if datums:
                fwd_bwd = training.forward_backward(datums, loss_fn="importance_sampling")
                optim = training.optim_step(adam)
                loss = fwd_bwd.result().metrics["loss:sum"]
                optim.result()
            row = {"step": step, "reward": sum(rewards) / len(rewards), "datums": len(datums), "loss": loss,
                   "seconds": time.perf_counter() - t0}
            print(f"step {step} | reward {row['reward']:.3f} | {len(datums)} datums | {row['seconds']:.1f} s",
                  flush=True)
            rows.append(row)
        return rows
    finally:
        service.close("success").result(120)


def main(argv: list[str] | None = None) -> list[dict]:
    """The command line: one --flag per LoopConfig field."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in fields(LoopConfig):
        required = f.default is MISSING
        parser.add_argument("--" + f.name.replace("_", "-"), required=required, default=None if required else f.default,
                            type=str if required else type(f.default))
    cfg = LoopConfig(**vars(parser.parse_args(argv)))
    print("tinker RL loop:", {k: v for k, v in asdict(cfg).items() if k != "api_key"}, flush=True)
    return run(cfg)


if __name__ == "__main__":
    main()
