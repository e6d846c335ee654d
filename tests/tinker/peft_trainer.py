"""A small real trainer for the Tinker tests: backend.Trainer over one PEFT model with one LoRA
adapter and one AdamW per experiment, on one copy of the tiny model, with Tinker's two losses.

What it does: what multi.MultiTrainer does for the Tinker service, in the fewest lines that
train for real (the adapters it saves are loaded by the CPU engine): `forward_backward` sums
Tinker's cross_entropy (-Σ w·log p) or importance_sampling (-Σ A·p/q) over every datum's tokens
and accumulates the gradient; `optim_step` is one AdamW step with the client's parameters.

What it does not do: micro-batching, devices, checkpoints or anything of the production trainer.
"""
from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ATTN, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")


class PeftTrainer:
    def __init__(self, model_path: str | Path):
        self.base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        self.model = None
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.calls: list[tuple[str, str]] = []
        """(method, experiment) per call, in order."""

    def add(self, name: str, lora, learning_rate: float, seed: int) -> None:
        self.calls.append(("add", name))
        if lora.rank > 16:
            raise ValueError(f"rank {lora.rank}: this runtime's adapters have rank <= 16")
        torch.manual_seed(seed)
        targets = [*(ATTN if lora.train_attn else ()), *(MLP if lora.train_mlp else ())]
        cfg = LoraConfig(r=lora.rank, lora_alpha=2 * lora.rank, lora_dropout=0.0, bias="none", target_modules=targets,
                         task_type="CAUSAL_LM", init_lora_weights=True)
        if self.model is None:
            self.model = get_peft_model(self.base, cfg, adapter_name=name)
        else:
            self.model.add_adapter(name, cfg)
        params = [p for n, p in self.model.named_parameters() if f".{name}." in n]
        self.optimizers[name] = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)

    def remove(self, name: str) -> None:
        self.calls.append(("remove", name))
        self.optimizers.pop(name)
        if self.optimizers:
            self.model.set_adapter(next(iter(self.optimizers)))
            self.model.delete_adapter(name)

    def _logprobs(self, name: str, input_ids: list[int], targets: list[int]) -> torch.Tensor:
        self.model.set_adapter(name)
        logits = self.model(input_ids=torch.tensor([input_ids])).logits[0].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets)[:, None])[:, 0]

    def forward_backward(self, name: str, batch, loss_fn: str = "importance_sampling", **kwargs) -> dict:
        self.calls.append(("forward_backward", name))
        total, logprobs = 0.0, []
        for d in batch:
            lp = self._logprobs(name, d.input_ids, d.target_ids)
            if loss_fn == "cross_entropy":
                loss = -(torch.tensor(d.weights) * lp).sum()
            elif loss_fn == "importance_sampling":
                ratio = torch.exp(lp - torch.tensor(d.sampling_logprobs))
                loss = -(ratio * torch.tensor(d.advantages)).sum()
            else:
                raise ValueError(f"loss_fn {loss_fn!r}")
            loss.backward()
            total += loss.item()
            logprobs.append(lp.detach().tolist())
        return {"loss": total, "logprobs": logprobs}

    def optim_step(self, name: str, learning_rate=None, betas=None, eps=None, weight_decay=None) -> dict:
        self.calls.append(("optim_step", name))
        opt = self.optimizers[name]
        for group in opt.param_groups:
            for key, value in (("lr", learning_rate), ("betas", betas), ("eps", eps), ("weight_decay", weight_decay)):
                if value is not None:
                    group[key] = value
        grad_norm = torch.norm(torch.stack([p.grad.norm() for g in opt.param_groups for p in g["params"]
                                            if p.grad is not None])).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm}

    def save_adapter(self, name: str, directory) -> Path:
        self.calls.append(("save_adapter", name))
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        state = get_peft_model_state_dict(self.model, adapter_name=name)
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(path / "adapter_model.safetensors"))
        self.model.peft_config[name].save_pretrained(str(path))
        return path

    @torch.no_grad()
    def score(self, name: str, token_ids: list[int]) -> list[float]:
        return self._logprobs(name, token_ids[:-1], token_ids[1:]).tolist()
