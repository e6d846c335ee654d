"""The LoRA policy trainer: one GRPO update per call, on the kernel's device.

What it does: loads the base model with a PEFT LoRA adapter on the attention and MLP projections
(Unsloth's FastLanguageModel when a CUDA GPU is present and Unsloth imports, plain transformers +
PEFT otherwise), turns rollout groups into padded tensors, scores their completion tokens at the
sampling temperature (`logprobs.py`: TRL's fused kernel on a GPU, so the vocabulary-wide logits are
never made), and applies `grpo.policy_loss` with gradient accumulation over micro-batches of
similar lengths within a token budget (sized from the free GPU memory unless set; an update that
runs out of memory is redone with half of it), AdamW and gradient clipping. It saves and restores everything a resumed run
needs (adapter, optimizer, step, RNG) as safetensors + JSON.

What it does not do: generate text (the server does), talk HTTP, or decide what the loss is (that
is `grpo.py`). One optimizer step per batch of rollouts (TRL's `num_iterations=1`), so the
"old" policy of the PPO ratio is the current one, detached.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file

# transformers, peft and trl are imported where used, not here: on a GPU, Unsloth must patch them
# before their first import, and importing Unsloth initialises CUDA, so it waits for the GPU plan
# (trainer._load_unsloth). Importing artsg_nb.run.session therefore imports none of them.
from ..rollout.trajectory import is_trainable
from .checkpoint import (ADAPTER_FILE, OPTIMIZER_FILE, STATE_FILE, CheckpointError, CheckpointSnapshot,
                         CheckpointWriter, checkpoint_dir, optimizer_from_tensors, optimizer_state,
                         read_checkpoint_file, write_checkpoint)
from .grpo import GRPOConfig, compute_advantages, importance_sampling_ratio, policy_loss
from .logprobs import attention_backends, fusable, fused_kernel, text_config, token_logprobs
from .step_stats import StepStats, batch_counts, is_ratio_stats
from .tensor_io import HostStaging, host_copies
from .update_timing import SlowUpdates, UpdateTimer, UpdateTiming

log = logging.getLogger(__name__)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WARM_UP_SHAPES = ((1, 32), (2, 48))
"""The (rows, length) micro-batches of Trainer.warm_up: different in both sizes, and small: it runs
while the server starts, on a shared GPU beside it (96 tokens of fp32 logits: 58 MB at a 150k vocab)."""
FUSED_TOLERANCE = 0.02
"""Largest mean |difference| (nats per token) between the fused logprobs and the logits' on the
trainer's check (`Trainer.check_fused`); bf16 rounding of the two orders of summation is ~0.005."""
CPU_MICRO_BATCH_TOKENS = 8192
"""The token budget of a micro-batch on a CPU (or when the GPU's memory cannot be read)."""
GPU_MICRO_BATCH_TOKENS = (2048, 32768)
"""The range of the budget sized from free GPU memory (`auto_micro_batch_tokens`): fewer, larger
micro-batches pay the per-layer launch overhead of a small model fewer times."""


@dataclass
class TrainerConfig:
    model_path: str
    """Base model directory (Hugging Face format)."""
    lora_rank: int = 16
    """LoRA rank r. vLLM accepts only 1, 8, 16, 32, 64, ...; SGLang needs r <= --max-lora-rank."""
    lora_alpha: int = 32
    """LoRA alpha; the update is scaled by alpha / r (no rsLoRA: SGLang ignores it)."""
    target_modules: tuple[str, ...] = LORA_TARGETS
    """Modules that get adapters; the server must be started with the same list."""
    learning_rate: float = 1e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm."""
    micro_batch_tokens: int | None = None
    """Token budget of one forward/backward (padded batch size x length). None: sized at every
    update from the free GPU memory and the model's shape (`auto_micro_batch_tokens`),
    CPU_MICRO_BATCH_TOKENS on a CPU."""
    fused_logprobs: bool = True
    """Score with TRL's fused logprob kernel where it imports (a CUDA GPU with Triton): the LM head
    projects only the completion tokens, in tiles, and no (B, L, vocab) logits are made. Checked
    against the logits once (`Trainer.check_fused`); a model it does not reproduce keeps the logits."""
    packing: bool = False
    """Packed micro-batches: the sequences of a micro-batch are packed first-fit into rows as long
    as its longest sequence, with per-sequence position ids (transformers masks attention
    block-diagonally), so fewer rows and less padding go through the model; the loss is the
    padded one's. Off by default: on 2 shared CPU cores it measured from 2x faster to 2x slower
    (noise), and Unsloth's kernels are not checked with packed rows; measure on the GPU first."""
    device: str = "auto"
    """"cuda", "cpu" or "auto" (CUDA when available)."""
    use_unsloth: str | bool = "auto"
    """Unsloth's FastLanguageModel: "auto" uses it when CUDA is present, it imports, and the model's
    attention heads are at least UNSLOTH_MIN_HEAD_DIM wide (`unsloth_fits`)."""
    gradient_checkpointing: bool = False
    """Trade compute for memory on long sequences."""
    seed: int = 0
    """Seeds LoRA initialisation and the trainer's RNG."""
    warm_up: bool = True
    """Run the update's code once on made-up tokens when the trainer is built (`Trainer.warm_up`), so
    the first real update does not pay the one-off costs: CUDA and cuBLAS start-up, Unsloth's and
    torch.compile's compilation, the first imports. GRPORun builds the trainer while the server
    starts, so these costs hide behind the server's start. Nothing of the trainer's state changes."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """The loss; `grpo.temperature` must equal the sampling temperature."""


@dataclass
class Batch:
    """Valid trajectories of one step as tensors (B sequences, L tokens, padded right)."""

    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    completion_mask: torch.Tensor  # (B, L-1): 1 where token t+1 was generated by the model
    sampling_logps: torch.Tensor  # (B, L-1): the server's logprob of token t+1
    advantages: torch.Tensor  # (B,)
    rewards: torch.Tensor  # (B,)
    group_ids: torch.Tensor  # (B,)


class Trainer:
    """Holds the PEFT model and optimizer; `train_step(groups)` is one GRPO update."""

    def __init__(self, cfg: TrainerConfig, loaded: tuple | None = None, adapter_name: str = "default"):
        """`loaded`: a (PEFT model, tokenizer, backend) already loaded, whose active adapter
        `adapter_name` is the one this trainer trains (multi.MultiTrainer: one Trainer per
        experiment on one copy of the base model); None loads cfg.model_path with one adapter."""
        self.cfg = cfg
        self.step = 0
        self.adapter_name = adapter_name
        """The PEFT adapter this trainer trains, saves and restores."""
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.device = _pick_device(cfg.device)
        self.model, self.tokenizer, self.backend = loaded if loaded is not None else _load_model(cfg, self.device)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        """The adapter's parameters, as the optimizer holds them: listed once, as walking the model
        for them took 1.5-3.5 ms at every update and every save (SmolLM2, 2026-12-06)."""
        self.optimizer = torch.optim.AdamW(self.trainable, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        self.checkpoints = CheckpointWriter()
        self.logprob_kernel = fused_kernel() if cfg.fused_logprobs and self.device.type == "cuda" else None
        """The fused logprob kernel in use (logprobs.py; None: the model's logits)."""
        self._fused_checked = self.logprob_kernel is None
        self._oom_budget: int | None = None  # a budget that ran out of memory: later ones stay below it
        self._adapter_views: tuple[tuple[int, ...], dict] | None = None  # _adapter_state's (data_ptrs, state dict)
        self._adapter_staging = HostStaging()  # save_adapter's CPU copy, reused from step to step
        log.info("trainer on %s (%s), %d trainable tensors", self.device, self.backend, len(self.trainable))
        self.last_update: UpdateTiming | None = None
        """Where the latest train_step's seconds went (update_timing.py)."""
        self._slow_updates = SlowUpdates()
        self.warm_up_s = self.warm_up() if cfg.warm_up else None
        """Seconds `warm_up` took when the trainer was built (None: TrainerConfig.warm_up off)."""

    def close(self) -> None:
        """Wait for the checkpoint still being written (distributed.RankedTrainer also stops its ranks)."""
        self.checkpoints.close()

    def warm_up(self, shapes: tuple[tuple[int, int], ...] = WARM_UP_SHAPES) -> float:
        """One forward and backward of the update's own code (`micro_batch_loss`) per (rows, length)
        in `shapes`, on made-up tokens, and one `score_tokens`; seconds taken. Two shapes that differ
        in both sizes: torch.compile compiles for the first and recompiles once with dynamic sizes at
        the second, so real batches reuse that graph. The gradients are dropped and the RNG states put
        back: weights, optimizer, step and every later draw are the same as without it (tests check).
        It also runs `check_fused`, which may switch the trainer to the logits."""
        t0 = time.perf_counter()
        rng = _rng_states(self.device)
        try:
            self.model.train()
            vocab = self.model.get_input_embeddings().num_embeddings
            for rows, length in shapes:
                mb = _made_up_batch(rows, length, vocab)
                loss, _, _ = self.micro_batch_loss(_slice(mb, list(range(rows)), self.device), rows,
                                                   mb.completion_mask.sum())
                loss.backward()
            self.score_tokens(_made_up_batch(1, shapes[0][1], vocab).input_ids[0].tolist())
            self.check_fused()
        except torch.cuda.OutOfMemoryError as e:  # a server starting on the same GPU took it: not needed
            log.warning("trainer warm-up skipped: out of GPU memory (%s); the first update pays its one-off "
                        "costs instead", str(e).splitlines()[0])
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            _set_rng_states(rng)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the server may be measuring free memory right now
        seconds = time.perf_counter() - t0
        log.info("trainer warmed up in %.2f s (first-call costs, paid while the server starts)", seconds)
        return seconds

    # ---- one GRPO update -------------------------------------------------------------------
    def train_step(self, groups) -> dict:
        """Advantages → loss → one optimizer step over all valid trajectories of `groups`. Out of
        GPU memory, the gradients are dropped and the update redone in micro-batches of half the
        tokens (down to GPU_MICRO_BATCH_TOKENS[0]); later updates stay below that budget."""
        with UpdateTimer(self.device) as timer:
            result = self._train_step(groups, timer)
        self.last_update = timer.timing
        multiple = self._slow_updates.slow(timer.timing)
        if multiple is not None:
            log.warning("trainer: update %d took %.0fx the run's median update, %s", self.step, multiple,
                        timer.timing.why())
        return result

    def _train_step(self, groups, timer: UpdateTimer) -> dict:
        batch = self.make_batch(groups)
        while True:
            budget = None
            try:
                self._checked_kernel()  # first: the budget depends on whether the fused path stays
                budget = self.micro_batch_tokens()
                stats = self.backward(batch, budget=budget)
                break
            except torch.cuda.OutOfMemoryError:
                self.optimizer.zero_grad(set_to_none=True)
                if budget is None or budget <= GPU_MICRO_BATCH_TOKENS[0]:  # None: the kernel check itself
                    raise
            # out of memory; here, outside the except, its traceback no longer holds the failed graph
            self.release_cached_memory()
            self._oom_budget = budget
            log.warning("trainer: out of GPU memory with micro-batches of %d tokens; redoing the update with "
                        "%d (set micro_batch_tokens to choose)", budget, self.micro_batch_tokens())
        with timer.checkpoint_wait():
            self.checkpoints.wait_taken()
        return {**stats.result(), "grad_norm": self.optimizer_step(), **batch_counts(batch),
                "micro_batch_tokens": budget}

    def release_cached_memory(self) -> None:
        """Give the GPU memory PyTorch holds cached back to the device (the server takes its
        memory back after a released update: run/released.py); a no-op on a CPU."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def micro_batch_tokens(self) -> int:
        """This update's micro-batch token budget: TrainerConfig.micro_batch_tokens, else sized
        from the free GPU memory (`auto_micro_batch_tokens`); at most half a budget that ran out of memory."""
        if self.cfg.micro_batch_tokens is not None:
            budget = int(self.cfg.micro_batch_tokens)
        elif self.device.type != "cuda":
            return CPU_MICRO_BATCH_TOKENS
        else:
            free = torch.cuda.mem_get_info(self.device)[0]
            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            budget = auto_micro_batch_tokens(self.model.config, free + cached,  # its own cache is free to it
                                             fused=self.logprob_kernel is not None and not self.packing)
        if self._oom_budget is not None:
            budget = max(GPU_MICRO_BATCH_TOKENS[0], min(budget, self._oom_budget // 2))
        return budget

    def backward(self, batch: Batch, part: Batch | None = None, budget: int | None = None) -> StepStats:
        """Forward and backward of `part` of `batch` (all of it by default) in micro-batches of
        `budget` tokens (None: `micro_batch_tokens()`), each loss normalised by the *whole* batch's
        sequences / completion tokens, so the gradients of disjoint parts add up to the whole
        batch's (distributed.ddp_train_step)."""
        n_seq = batch.input_ids.shape[0]
        n_items = batch.completion_mask.sum().clamp(min=1)
        stats = StepStats()
        self.model.train()
        log.info("trainer: forward/backward of %d of %d sequences (%d tokens) on %s", (part or batch).input_ids.shape[0],
                 n_seq, int((part or batch).attention_mask.sum()), self.device)
        for mb in self.micro_batches(batch if part is None else part, budget):
            loss, metrics, logps = self.micro_batch_loss(mb, n_seq, n_items)
            loss.backward()
            stats.add(loss.item(), metrics, mb.completion_mask.sum().item(),
                      is_ratio_stats(logps.detach(), mb.sampling_logps, mb.completion_mask))
        return stats

    def optimizer_step(self) -> float:
        """Clip the accumulated gradients, step AdamW, zero them; returns the gradient norm. First
        waits for the checkpoint writer to have copied the optimizer state it was handed."""
        self.checkpoints.wait_taken()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.cfg.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(grad_norm)

    def micro_batches(self, batch: Batch, budget: int | None = None):
        """`batch` in micro-batches of at most `budget` tokens (None: `micro_batch_tokens()`), each
        of sequences of similar length (`_micro_batches`), on the trainer's device."""
        budget = self.micro_batch_tokens() if budget is None else budget
        for idx in _micro_batches(batch.attention_mask.sum(1).tolist(), budget):
            yield _slice(batch, idx, self.device)

    def micro_batch_loss(self, mb: Batch, n_seq: int, n_items) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """(loss, its metrics, the (b, L-1) logprobs with grad) of one micro-batch, normalised by the
        whole batch's `n_seq` sequences / `n_items` completion tokens (grpo.policy_loss)."""
        g = self.cfg.grpo
        logps = (self.score_packed(mb.input_ids, mb.attention_mask) if self.packing
                 else self.score(mb.input_ids, mb.attention_mask, mb.completion_mask.bool()))
        ref = self._ref_logps(mb) if g.beta else None
        is_ratio = (importance_sampling_ratio(logps.detach(), mb.sampling_logps, mb.completion_mask, g)
                    if g.is_mode else None)
        loss, metrics = policy_loss(logps, None, mb.advantages, mb.completion_mask, g, ref_logps=ref,
                                    is_ratio=is_ratio, num_sequences=n_seq, num_items=n_items)
        return loss, metrics, logps

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              wanted: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L-1) logprobs of tokens 1..L-1 at the sampling temperature (as the server), where
        `wanted` is set (None: every real token), 0 elsewhere (logprobs.token_logprobs)."""
        return token_logprobs(self.model, input_ids, attention_mask, self.cfg.grpo.temperature, wanted,
                              self._checked_kernel())

    def _checked_kernel(self):
        if not self._fused_checked:
            self.check_fused()
        return self.logprob_kernel

    @torch.no_grad()
    def check_fused(self) -> bool:
        """Whether the fused logprobs agree with the logits' (FUSED_TOLERANCE) on made-up tokens,
        under the current weights; if not, the trainer keeps the logits from now on (logged).
        Runs once, at warm-up or before the first scoring."""
        if self._fused_checked:
            return self.logprob_kernel is not None
        if not fusable(self.model):
            log.info("trainer: the model's LM head is not a plain Linear under its backbone; scoring with the logits")
            return self._keep_logits()
        try:
            diff = self._fused_difference()
        except torch.cuda.OutOfMemoryError:
            raise  # not a verdict: checked again before the first scoring
        except Exception as e:  # a kernel that cannot run on this model (Triton, an unusual backbone)
            log.warning("trainer: the fused logprobs failed on this model (%r); scoring with the logits instead", e)
            return self._keep_logits()
        self._fused_checked = True
        if not diff <= FUSED_TOLERANCE:  # NaN too
            log.warning("trainer: the fused logprobs differ from the logits' by %.3g nats a token (tolerance %g) on "
                        "this model; scoring with the logits instead (slower, more memory)", diff, FUSED_TOLERANCE)
            return self._keep_logits()
        log.info("trainer: fused logprobs agree with the logits (mean |diff| %.2g nats)", diff)
        return True

    def _keep_logits(self) -> bool:
        self.logprob_kernel, self._fused_checked = None, True
        return False

    def _fused_difference(self) -> float:
        """Mean |fused - logits| logprob on made-up tokens, with the LoRA B matrices (zero in a new
        adapter) moved off zero for the comparison, so it sees the adapter applied, then put back."""
        vocab = self.model.get_input_embeddings().num_embeddings
        mb = _made_up_batch(2, 48, vocab)
        ids, mask = mb.input_ids.to(self.device), mb.attention_mask.to(self.device)
        t = self.cfg.grpo.temperature
        lora_b = [p for n, p in self.model.named_parameters() if p.requires_grad and "lora_B" in n]
        saved, training = [p.detach().clone() for p in lora_b], self.model.training
        self.model.eval()  # no dropout: both passes see the same network, and no RNG is drawn
        try:
            for i, p in enumerate(lora_b):  # fixed values, no RNG draw: the trainer's streams stay untouched
                p.data.add_(torch.cos(torch.arange(p.numel(), device=p.device, dtype=torch.float32) + i)
                            .reshape(p.shape).to(p.dtype) * 0.02)
            fused = token_logprobs(self.model, ids, mask, t, kernel=self.logprob_kernel)
            plain = token_logprobs(self.model, ids, mask, t, kernel=None)
        finally:
            for p, s in zip(lora_b, saved):
                p.data.copy_(s)
            self.model.train(training)
        return (fused - plain).abs().mean().item()

    @property
    def packing(self) -> bool:
        """Whether train_step packs micro-batches (TrainerConfig.packing)."""
        return bool(self.cfg.packing)

    def score_packed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """`score` of right-padded rows, computed on fewer rows: sequences are packed first-fit
        into rows no longer than the longest one (so attention costs at most what padding did),
        each with its own position ids. The result is laid out as `score`'s (B, L-1), 0 past
        each sequence's end."""
        from trl.trainer.utils import selective_log_softmax
        lengths = attention_mask.sum(1).tolist()
        width = max(lengths)
        rows, used, place = [], [], {}
        for b in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            r = next((r for r, u in enumerate(used) if u + lengths[b] <= width), None)
            if r is None:
                rows.append([])
                used.append(0)
                r = len(rows) - 1
            place[b] = (r, used[r])
            rows[r].append(b)
            used[r] += lengths[b]
        dev = input_ids.device
        ids = torch.zeros((len(rows), width), dtype=input_ids.dtype, device=dev)
        pos = torch.zeros((len(rows), width), dtype=torch.long, device=dev)
        for b, (r, o) in place.items():
            n = lengths[b]
            ids[r, o:o + n] = input_ids[b, :n]
            pos[r, o:o + n] = torch.arange(n, device=dev)
        for r, u in enumerate(used):  # the row's tail is a sequence of its own, read by nobody
            pos[r, u:] = torch.arange(width - u, device=dev)
        # no attention mask and no KV cache: transformers then reads the sequence starts off the
        # position ids and masks attention block-diagonally (masking_utils.find_packed_sequence_indices)
        with attention_backends():
            logits = self.model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, :-1]
        lp = selective_log_softmax(logits.float() / self.cfg.grpo.temperature, ids[:, 1:])  # (R, width-1)
        valid = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
        cols = torch.arange(input_ids.shape[1] - 1, device=dev)
        row_of = torch.tensor([place[b][0] for b in range(len(lengths))], device=dev)
        off_of = torch.tensor([place[b][1] for b in range(len(lengths))], device=dev)
        r_idx = row_of[:, None].expand_as(valid)[valid]
        c_idx = (off_of[:, None] + cols[None, :])[valid]
        out = torch.zeros(valid.shape, dtype=lp.dtype, device=dev)
        return out.masked_scatter(valid, lp[r_idx, c_idx])

    @torch.no_grad()
    def score_tokens(self, token_ids: list[int]) -> list[float]:
        """Logprobs of token_ids[1:] under the current adapter (the served-adapter probe)."""
        self.model.eval()
        ids = torch.tensor([token_ids], device=self.device)
        return self.score(ids, torch.ones_like(ids))[0].tolist()

    def make_batch(self, groups) -> Batch:
        """Flatten the valid trajectories of `groups`; advantages per group (grpo.py)."""
        trajs, gids = [], []
        for gi, group in enumerate(groups):
            for t in group.trajectories:
                if is_trainable(t):
                    trajs.append(t)
                    gids.append(gi)
        if not trajs:
            raise ValueError("no valid trajectory to train on: every rollout failed or was empty "
                             "(see the history's failed_rollouts and the server log)")
        L = max(len(t.token_ids) for t in trajs)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(trajs), L), pad, dtype=torch.long)
        attn = torch.zeros((len(trajs), L), dtype=torch.long)
        cmask = torch.zeros((len(trajs), L), dtype=torch.float32)
        slp = torch.zeros((len(trajs), L), dtype=torch.float32)
        for i, t in enumerate(trajs):
            n = len(t.token_ids)
            ids[i, :n] = torch.tensor(t.token_ids)
            attn[i, :n] = 1
            cmask[i, :n] = torch.tensor(t.completion_mask, dtype=torch.float32)
            slp[i, :n] = torch.tensor([x if x is not None else float("nan") for x in t.logprobs])
        # float64: a finite Python reward beyond float32's range (1e39) would become inf in float32.
        rewards = torch.tensor([float(t.reward) for t in trajs], dtype=torch.float64)
        group_ids = torch.tensor(gids)
        adv = compute_advantages(rewards, group_ids, self.cfg.grpo.scale_rewards)
        if not torch.isfinite(adv).all():  # a real check, not compute_advantages' assert (python -O drops those)
            raise ValueError(f"rewards {rewards.min().item():.3g}..{rewards.max().item():.3g} give non-finite "
                             "advantages; nothing was trained. Try: keep the task's rewards in a moderate range "
                             "(e.g. 0..1)")
        return Batch(ids, attn, cmask[:, 1:], slp[:, 1:], adv.float(), rewards, group_ids)

    def _ref_logps(self, mb: Batch) -> torch.Tensor:
        """π_ref = the base model: the same network with the adapter disabled."""
        with torch.no_grad(), self.model.disable_adapter():
            return self.score(mb.input_ids, mb.attention_mask, mb.completion_mask.bool())

    # ---- adapter and checkpoint I/O ----------------------------------------------------------
    def save_adapter(self, path: str | Path) -> None:
        """PEFT adapter (adapter_config.json + adapter_model.safetensors) at `path`: the files
        `PeftModel.save_pretrained` writes, byte for byte in tensors and config, without its model
        card (README.md), which took 2/3 of the save (r16 on the tiny model: 200 → 60 ms on CPU)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._adapter_staging.save(self._adapter_state(), path / ADAPTER_FILE, metadata={"format": "pt"})
        config = self.model.peft_config[self.adapter_name]
        inference_mode, config.inference_mode = config.inference_mode, True  # as save_pretrained writes it
        try:
            config.save_pretrained(str(path))
        finally:
            config.inference_mode = inference_mode

    def _adapter_state(self) -> dict[str, torch.Tensor]:
        """PEFT's state dict of the adapter (get_peft_model_state_dict: its keys, the live LoRA
        weights), built once and reused while it views the trainable parameters themselves:
        building it walks the whole model's state_dict, 26-38 ms for SmolLM2 under Unsloth on an
        H100 (2026-12-06), half of the adapter's save. Built again when a trainable parameter's
        storage has changed; never reused when PEFT returned anything but views of them."""
        from peft import get_peft_model_state_dict
        live = tuple(p.data_ptr() for p in self.trainable)
        if self._adapter_views is not None and self._adapter_views[0] == live:
            return self._adapter_views[1]
        state = get_peft_model_state_dict(self.model, adapter_name=self.adapter_name)
        ptrs = set(live)
        views = all(t.data_ptr() in ptrs and t.numel() == t.untyped_storage().nbytes() // t.element_size()
                    for t in state.values())
        self._adapter_views = (live, state) if views else None
        return state

    def save_checkpoint(self, path: str | Path, wait: bool = True, before: Callable[[], None] | None = None) -> None:
        """Optimizer state, step and RNG into the `trainer/` folder of the version folder `path`
        (the adapter's; rl/checkpoint.py says why a folder of its own), after `before()` (the
        adapter's seal: lora.seal_version). wait=False: copied and written by a background thread
        while the caller goes on (checkpoint.CheckpointWriter; `_snapshot_taker`);
        `wait_for_checkpoint`, `load_checkpoint` and `close` wait for it."""
        take = self._snapshot_taker()
        if wait:
            self.checkpoints.wait()  # in order: an earlier background write first
            write_checkpoint(take(), path, before)
        else:
            self.checkpoints.submit(take, path, before)

    def checkpoint_snapshot(self) -> CheckpointSnapshot:
        """What `save_checkpoint` writes, copied into CPU memory now."""
        return self._snapshot_taker()()

    def _snapshot_taker(self) -> Callable[[], CheckpointSnapshot]:
        """`checkpoint_snapshot` in two halves: the step, RNG states and config are copied now; the
        optimizer's tensors (twice the adapter: 39 MB for SmolLM2 r16, on the GPU) when the
        function returned is called: by the checkpoint writer's thread, off the step's critical
        path. The optimizer must not move before then: `optimizer_step` waits for it."""
        live, meta = optimizer_state(self.optimizer)  # param groups (the lr) and scalars: as they are now
        state = {"step": self.step, "optimizer": meta, "python_random": _jsonable(random.getstate()),
                 "trainer_config": _jsonable(asdict(self.cfg))}
        rng = torch.get_rng_state()

        def take() -> CheckpointSnapshot:
            return CheckpointSnapshot({**host_copies(live), "rng.torch": rng}, state)
        return take

    def wait_for_checkpoint(self) -> None:
        """Block until the newest checkpoint (save_checkpoint(wait=False)) is on disk."""
        self.checkpoints.wait()

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore adapter weights, optimizer, step and RNG saved by `save_checkpoint` (a version
        whose background write failed: its optimizer state from memory)."""
        from peft import set_peft_model_state_dict

        path = Path(path)
        snapshot = self.checkpoints.unwritten(path)  # waits for a write still under way
        folder = checkpoint_dir(path)
        needed = [path / ADAPTER_FILE] + ([] if snapshot else [folder / OPTIMIZER_FILE, folder / STATE_FILE])
        missing = [str(f.relative_to(path)) for f in needed if not f.exists()]
        if missing:
            raise CheckpointError(f"checkpoint {path} is incomplete (missing {', '.join(missing)}); "
                                  "resume from an earlier step or start a new run directory")
        # Every file is read (and refused if corrupt) before anything is applied: a trainer
        # half-restored from a corrupt checkpoint would silently train on from mixed states.
        weights = read_checkpoint_file(path / ADAPTER_FILE, lambda f: load_file(str(f)), path)
        if snapshot is None:
            state = read_checkpoint_file(folder / STATE_FILE, lambda f: json.loads(f.read_text()), path)
            tensors = read_checkpoint_file(folder / OPTIMIZER_FILE, lambda f: load_file(str(f)), path)
        else:  # copies: the optimizer must not share tensors with a snapshot a later rollback reads
            state, tensors = copy.deepcopy(snapshot.state), {k: v.clone() for k, v in snapshot.tensors.items()}
        saved = state.get("trainer_config", {})
        for key in ("lora_rank", "lora_alpha", "target_modules"):
            if key in saved and _jsonable(getattr(self.cfg, key)) != saved[key]:
                raise CheckpointError(f"checkpoint {path} was trained with {key}={saved[key]!r} but this run "
                                      f"has {getattr(self.cfg, key)!r}; use the same LoRA settings or a new run dir")
        set_peft_model_state_dict(self.model, weights, adapter_name=self.adapter_name)
        optimizer_from_tensors(self.optimizer, tensors, state["optimizer"])
        torch.set_rng_state(tensors["rng.torch"])
        random.setstate(_tuplify(state["python_random"]))
        self.step = state["step"]


# ---- warm-up -----------------------------------------------------------------------------------
def _made_up_batch(rows: int, length: int, vocab: int) -> Batch:
    """A batch of fixed token ids (no RNG draw), the second half of each row a completion."""
    ids = (torch.arange(rows * length).reshape(rows, length) * 7919 + 13) % vocab
    completion = torch.zeros((rows, length - 1))
    completion[:, length // 2:] = 1.0
    return Batch(input_ids=ids, attention_mask=torch.ones_like(ids), completion_mask=completion,
                 sampling_logps=torch.full((rows, length - 1), -1.0), advantages=torch.linspace(-1.0, 1.0, rows),
                 rewards=torch.zeros(rows, dtype=torch.float64), group_ids=torch.zeros(rows, dtype=torch.long))


def _rng_states(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    return torch.get_rng_state(), cuda, random.getstate()


def _set_rng_states(states: tuple) -> None:
    cpu, cuda, python = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(python)


# ---- model loading ---------------------------------------------------------------------------
def _pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("TrainerConfig.device asks for CUDA but torch sees no GPU "
                           "(check CUDA_VISIBLE_DEVICES and the GPU plan, or use device='cpu')")
    return torch.device(device)


def _load_model(cfg: TrainerConfig, device: torch.device):
    want = cfg.use_unsloth
    if want is True or (want == "auto" and device.type == "cuda" and _unsloth_importable()
                        and unsloth_fits(cfg.model_path)):
        return (*_load_unsloth(cfg), "unsloth")
    return (*_load_peft(cfg, device), "transformers+peft")


def _unsloth_importable() -> bool:
    return importlib.util.find_spec("unsloth") is not None


UNSLOTH_MIN_HEAD_DIM = 64
"""Narrowest attention head Unsloth was seen to train correctly here. Seen on one H200 (Unsloth
2026.10.9, 2026-12-04): head_dim 64 (SmolLM2-135M, the Qwen2.5-0.5B shape) serves what it trains;
the offline tiny model's 16 gave logprobs 5.5 nats from the server's under the adapter it had just
saved (the served-adapter check failed at step 1), where transformers + PEFT agree within the
check's tolerance (mean difference <= 0.012, benchmarks/results/20261203-h200-gpu-tests.md)."""


def unsloth_fits(model_path: str) -> bool:
    """Whether "auto" should take Unsloth for the model at `model_path` (its config's head size)."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return True  # a hub id or an unreadable config: Unsloth decides
    head_dim = cfg.get("head_dim") or cfg.get("hidden_size", 0) // max(cfg.get("num_attention_heads", 1), 1)
    return head_dim >= UNSLOTH_MIN_HEAD_DIM


def _lora_config(cfg: TrainerConfig):
    from peft import LoraConfig
    # The subset both SGLang and vLLM accept: no dropout, bias, DoRA, rsLoRA or modules_to_save.
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, bias="none",
                      target_modules=list(cfg.target_modules), task_type="CAUSAL_LM")


def _load_peft(cfg: TrainerConfig, device: torch.device):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=dtype).to(device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
    model = get_peft_model(model, _lora_config(cfg))
    return model, AutoTokenizer.from_pretrained(cfg.model_path)


def _load_unsloth(cfg: TrainerConfig):
    os.environ.setdefault("UNSLOTH_RETURN_LOGITS", "1")  # we need logits to score at temperature T
    from unsloth import FastLanguageModel  # lazy: importing it patches transformers and initialises CUDA

    model, tokenizer = FastLanguageModel.from_pretrained(model_name=cfg.model_path, load_in_4bit=False,
                                                         dtype=torch.bfloat16, max_seq_length=8192)
    model = FastLanguageModel.get_peft_model(
        model, r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, bias="none",
        target_modules=list(cfg.target_modules), random_state=cfg.seed,
        use_gradient_checkpointing="unsloth" if cfg.gradient_checkpointing else False)
    return model, tokenizer


# ---- batching helpers ------------------------------------------------------------------------
def auto_micro_batch_tokens(config, free_bytes: int, fused: bool) -> int:
    """A micro-batch token budget that fits in 60 % of `free_bytes`: per token, the activations the
    decoder layers keep for the backward (bf16; ~10 values of the hidden size and ~6 of the MLP's
    a layer, a third more than a Llama layer saves), plus the vocabulary-wide logits, their fp32
    copy and gradient unless `fused`; within GPU_MICRO_BATCH_TOKENS, a multiple of 1024. An
    estimate: train_step halves a budget that runs out of memory."""
    text = text_config(config)
    hidden = int(getattr(text, "hidden_size", 4096))
    mlp = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    layers = int(getattr(text, "num_hidden_layers", 32))
    per_token = layers * (hidden * 10 + mlp * 6) * 2 + (0 if fused else int(getattr(text, "vocab_size", 32000)) * 12)
    lo, hi = GPU_MICRO_BATCH_TOKENS
    return max(lo, min(hi, int(free_bytes * 0.6 / per_token) // 1024 * 1024))


def _micro_batches(lengths: list[int], budget_tokens: int) -> list[list[int]]:
    """Index groups whose padded size (count x longest) fits the token budget, taken in order of
    length (longest first), so a micro-batch's sequences are of similar length and little of it is
    padding; each group's indices ascending. The loss of each part is normalised by the whole
    batch, so the order changes nothing but the padding."""
    out, cur, longest = [], [], 0
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if cur and (len(cur) + 1) * max(longest, n) > budget_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return [sorted(group) for group in out]


def _slice(b: Batch, idx: list[int], device: torch.device) -> Batch:
    L = int(b.attention_mask[idx].sum(1).max())  # trim padding shared by the whole micro-batch
    pick = lambda t, n: t[idx][:, :n].to(device)  # noqa: E731
    return Batch(pick(b.input_ids, L), pick(b.attention_mask, L), pick(b.completion_mask, L - 1),
                 pick(b.sampling_logps, L - 1), b.advantages[idx].to(device), b.rewards[idx], b.group_ids[idx])


def _jsonable(x):
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    return x


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, list) else x
