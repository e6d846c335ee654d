"""GRPO math: group-relative advantages, the clipped surrogate loss, the k3 KL penalty, and the
importance-sampling (IS) correction against the rollout server's sampling logprobs.

What it does: pure torch functions on tensors the trainer already has —
rewards → advantages (`compute_advantages`), server vs. trainer logprobs → IS weights
(`importance_sampling_ratio`), per-token logprobs → a scalar loss and a few metrics
(`policy_loss`). Each formula cites its paper; the reference implementation is TRL 1.15.0
`trl/trainer/grpo_trainer.py` (written below as `TRL:<line>`; 1.16.0's `_compute_loss` is
byte-identical). `tests/test_grpo_trl_oracle.py` runs TRL's own code on the same tensors.

What it does not: no model code and no logprob computation (the trainer scores completion
tokens itself, with the sampling temperature, so that π_θ and the server's π_sample are the
same distribution); no optimizer, no distributed reduction; only the token-level PPO ratio
(no GSPO sequence ratio), no two-sided `delta` clip, no entropy bonus, no reward shaping.

Symbols: i indexes the G completions o_i of one prompt, t their tokens, |o_i| the number of
model tokens in o_i; r_{i,t}(θ) = π_θ(o_{i,t}) / π_old(o_{i,t}); Â_i the advantage; ε_low,
ε_high the clip range; β the KL coefficient; w the IS weight. Shapes: B sequences, T tokens.

References: DeepSeekMath (Shao et al. 2024, arXiv:2402.03300) — GRPO objective eq. 3, KL
estimator eq. 4, group-normalised advantages §4.1.2. Dr. GRPO (Liu et al. 2025, "Understanding
R1-Zero-Like Training", arXiv:2503.20783). DAPO (Yu et al. 2025, arXiv:2503.14476) — Clip-Higher
and the token-level loss. k3: J. Schulman, "Approximating KL Divergence" (2020). Bias-corrected
KL: DeepSeek-V3.2 (arXiv:2512.02556). TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly
Brings You Off-Policy RL Training". MIS: IcePop (inclusionAI, Ring-1T report, 2025).
"""

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

LossType = Literal["grpo", "dr_grpo", "dapo"]
ScaleRewards = Literal["group", "batch", "none"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]

_STD_EPS = 1e-4  # TRL:2713 adds 1e-4 to σ (not max(σ, eps))


@dataclass
class GRPOConfig:
    loss_type: LossType = "dapo"
    """How per-token losses are averaged. "grpo": mean over sequences of each sequence's token
    mean (DeepSeekMath eq. 3); "dr_grpo": token sum / (G · max_completion_length) (Dr. GRPO);
    "dapo": token sum / total tokens in the batch (DAPO token-level loss). TRL's default."""
    scale_rewards: ScaleRewards = "group"
    """Divide advantages by the reward std of the group ("group", DeepSeekMath §4.1.2), of the
    whole batch ("batch"), or not at all ("none", as Dr. GRPO recommends)."""
    epsilon_low: float = 0.2
    """ε_low: the ratio is clipped from below at 1 - ε_low."""
    epsilon_high: float | None = 0.28
    """ε_high: the ratio is clipped from above at 1 + ε_high (DAPO "Clip-Higher", 0.28).
    None means ε_low (symmetric PPO clip)."""
    beta: float = 0.0
    """β, the KL(π_θ ‖ π_ref) coefficient. 0 needs no reference logprobs (TRL, DAPO default)."""
    use_bias_correction_kl: bool = True
    """Multiply the per-token k3 KL by r_{i,t}(θ) so its gradient is the unbiased reverse-KL
    gradient (DeepSeek-V3.2); TRL 1.15 default. Changes the KL gradient even on-policy."""
    is_mode: ISMode | None = None
    """Correction for the gap between the server's sampling logprobs and the trainer's π_old:
    "token_*" weights each token, "sequence_*" weights a whole sequence by exp(Σ_t Δ);
    "*_truncate" clamps the weight to [is_clip_min, is_clip_max] (TIS), "*_mask" zeroes weights
    outside that range (MIS / IcePop). None: no correction."""
    is_clip_min: float | None = None
    """Lower bound C_min of the IS weight (None: unbounded below)."""
    is_clip_max: float | None = 3.0
    """Upper bound C_max of the IS weight (None: unbounded above)."""
    max_completion_length: int = 256
    """Constant L in the dr_grpo normaliser G · L; should be the rollout's max_new_tokens."""
    temperature: float = 1.0
    """Sampling temperature. Not used here: the trainer must divide logits by it when scoring,
    so that its logprobs match the (temperature-scaled) logprobs SGLang returns."""

    def __post_init__(self):
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon_low  # TRL:923
        assert self.loss_type in ("grpo", "dr_grpo", "dapo"), f"unknown loss_type {self.loss_type!r}"
        assert self.scale_rewards in ("group", "batch", "none"), f"unknown scale_rewards {self.scale_rewards!r}"
        assert self.is_mode in (None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"), (
            f"unknown is_mode {self.is_mode!r}"
        )
        assert not (self.is_mode and self.is_mode.endswith("_truncate") and self.is_clip_min is None
                    and self.is_clip_max is None), f"is_mode={self.is_mode!r} needs is_clip_min or is_clip_max"


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------

def _group_index(group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Dense group index (B,) and the size of each group (K,), for any group ids."""
    _, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return index, counts


def compute_advantages(rewards: Tensor, group_ids: Tensor, scale_rewards: ScaleRewards = "group") -> Tensor:
    """Group-relative advantages Â_i = (R_i - mean(R_group)) / (std + 1e-4), shape (B,).

    DeepSeekMath §4.1.2 (outcome supervision); TRL:2691-2713. Groups may have different sizes
    (failed rollouts are dropped upstream). std is unbiased (Bessel), like TRL's `nanstd`; with
    scale_rewards="batch" it is one std over all rewards while the mean stays per group (TRL:2703).
    A group of one, or of identical rewards, gets Â = 0 (TRL: NaN std → 0 at TRL:2736).
    """
    assert rewards.dim() == 1 and rewards.shape == group_ids.shape, "rewards and group_ids must both be (B,)"
    assert torch.isfinite(rewards).all(), "rewards must be finite; drop failed rollouts before compute_advantages"
    assert scale_rewards in ("group", "batch", "none"), f"unknown scale_rewards {scale_rewards!r}"
    rewards = rewards.float() if not rewards.is_floating_point() else rewards
    index, counts = _group_index(group_ids)  # (B,), (K,)
    n = counts.to(rewards.dtype)
    mean = torch.zeros_like(n).index_add_(0, index, rewards) / n  # (K,)
    centred = rewards - mean[index]  # (B,)
    if scale_rewards == "group":
        var = torch.zeros_like(n).index_add_(0, index, centred**2) / (n - 1)  # (K,) Bessel; n=1 → inf/nan
        advantages = centred / (var.sqrt()[index] + _STD_EPS)
    elif scale_rewards == "batch":
        std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())  # unbiased
        advantages = centred / (std + _STD_EPS)
    else:
        advantages = centred
    # Exact zeros where the group carries no signal: size 1 (NaN std in TRL) or all rewards equal
    # (centred values can be ±1 ulp instead of 0 when the mean is not representable).
    return torch.where(_constant_group(rewards, index)[index], torch.zeros_like(advantages), advantages)


def _constant_group(rewards: Tensor, index: Tensor) -> Tensor:
    """(K,) bool: True where every reward in the group is the same."""
    k = int(index.max()) + 1
    hi = rewards.new_full((k,), -math.inf).scatter_reduce(0, index, rewards, "amax")
    lo = rewards.new_full((k,), math.inf).scatter_reduce(0, index, rewards, "amin")
    return hi == lo


def zero_advantage_groups(rewards: Tensor, group_ids: Tensor) -> int:
    """How many groups have identical rewards (no learning signal; DAPO dynamic sampling filters
    these out, we only count them for the history)."""
    index, _ = _group_index(group_ids)
    return int(_constant_group(rewards.float(), index).sum())


# ---------------------------------------------------------------------------------------------
# Importance sampling against the server's sampling distribution
# ---------------------------------------------------------------------------------------------

def importance_sampling_ratio(old_logps: Tensor, sampling_logps: Tensor, mask: Tensor, cfg: GRPOConfig) -> Tensor:
    """IS weight w = π_old / π_sample, truncated (TIS) or masked (MIS), without gradient.

    The server samples from π_sample, which differs from the trainer's π_old (other kernels,
    precision); w re-weights the policy-gradient term. TIS: Yao et al. 2025, "Your Efficient RL
    Framework Secretly Brings You Off-Policy RL Training"; MIS: IcePop (Ring-1T, 2025). TRL:2587-2631.
    Token modes: w_{i,t} = exp(Δ_{i,t}), shape (B, T). Sequence modes: w_i = exp(Σ_t Δ_{i,t})
    (a sum, not a mean), shape (B, 1). Δ = (log π_old - log π_sample) · mask; a NaN Δ (no server
    logprob) counts as 0, i.e. no correction for that token.
    """
    assert cfg.is_mode is not None, "cfg.is_mode is None: no IS correction configured (pass is_ratio=None)"
    with torch.no_grad():
        diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)  # (B, T)
        if cfg.is_mode.startswith("sequence"):
            diff = diff.sum(dim=-1, keepdim=True)  # (B, 1)
        ratio = torch.exp(diff)
        if cfg.is_mode.endswith("_truncate"):
            return torch.clamp(ratio, min=cfg.is_clip_min, max=cfg.is_clip_max)
        lo = -math.inf if cfg.is_clip_min is None else cfg.is_clip_min
        hi = math.inf if cfg.is_clip_max is None else cfg.is_clip_max
        return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


# ---------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------

def policy_loss(
    logps: Tensor,
    old_logps: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: GRPOConfig,
    ref_logps: Tensor | None = None,
    is_ratio: Tensor | None = None,
    num_sequences: int | None = None,
    num_items: int | float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The GRPO / Dr. GRPO / DAPO loss (to minimise) of one (micro-)batch, and its metrics.

    logps (B, T): log π_θ of the completion tokens, with grad. old_logps (B, T): log π_old, no
    grad; None means on-policy (old = logps.detach(), TRL:2992), where the gradient is REINFORCE's.
    advantages (B,); mask (B, T), 1 on model tokens; ref_logps (B, T) needed when β != 0;
    is_ratio (B, T) or (B, 1) from `importance_sampling_ratio`.

    Micro-batching: pass the full batch's `num_sequences` (grpo, dr_grpo) and `num_items` =
    masked tokens of the full batch (dapo); then the micro-batch losses sum to the full-batch
    loss, values and gradients. With the defaults (this call is the whole batch) the loss equals
    TRL's `_compute_loss` with one process and no gradient accumulation.

    Metrics (floats over this call's masked tokens, as TRL:3185-3207): kl (NaN without ref_logps),
    clip_frac_low, clip_frac_high, clip_frac (region), is_ratio_mean/min/max (NaN without
    is_ratio), tokens (masked tokens here, to weight averages across micro-batches).
    """
    B = logps.shape[0]
    assert advantages.shape == (B,), f"advantages must be (B,)=({B},), got {tuple(advantages.shape)}"
    assert mask.shape == logps.shape, "mask must have the shape of logps"
    assert cfg.beta == 0.0 or ref_logps is not None, "beta != 0 needs ref_logps"
    mask = mask.to(logps.dtype)
    adv = advantages.to(logps.dtype).unsqueeze(1)  # (B, 1)
    old_logps = logps.detach() if old_logps is None else old_logps

    # r_{i,t}(θ) = π_θ / π_old; the gradient flows through exp (TRL:3009-3021).
    ratio = torch.exp(logps - old_logps)  # (B, T)
    clipped = torch.clamp(ratio, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
    # Clipped surrogate, DeepSeekMath eq. 3 with DAPO's decoupled ε_low/ε_high (TRL:3039-3046).
    per_token = -torch.min(ratio * adv, clipped * adv)  # (B, T)
    if is_ratio is not None:
        per_token = per_token * is_ratio  # IS weight on the policy term only, not on KL (TRL:3073)

    kl = None
    if ref_logps is not None:
        # k3 estimator (Schulman 2020, "Approximating KL Divergence"; DeepSeekMath eq. 4):
        # D_KL ≈ π_ref/π_θ - log(π_ref/π_θ) - 1 ≥ 0 (TRL:3026-3031).
        log_ref_ratio = ref_logps - logps
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # (B, T)
        if cfg.use_bias_correction_kl:
            kl = kl * ratio  # DeepSeek-V3.2 unbiased KL
        if cfg.beta != 0.0:
            per_token = per_token + cfg.beta * kl  # TRL:3076

    loss = _aggregate(per_token * mask, mask, cfg, num_sequences or B, num_items)
    return loss, _metrics(ratio, adv, mask, kl, is_ratio, cfg)


def _aggregate(masked_loss: Tensor, mask: Tensor, cfg: GRPOConfig, num_sequences: int,
               num_items: int | float | Tensor | None) -> Tensor:
    """Reduce (B, T) masked per-token losses to a scalar so that micro-batches add up."""
    if cfg.loss_type == "grpo":
        # 1/G Σ_i 1/|o_i| Σ_t ℓ_{i,t}  (DeepSeekMath eq. 3; TRL:3080)
        per_sequence = masked_loss.sum(-1) / mask.sum(-1).clamp(min=1.0)  # (B,)
        return per_sequence.sum() / num_sequences
    if cfg.loss_type == "dr_grpo":
        # 1/(G·L) Σ_i Σ_t ℓ_{i,t}, L a constant (Dr. GRPO; TRL:3090)
        return masked_loss.sum() / (num_sequences * cfg.max_completion_length)
    # dapo: 1/Σ_i|o_i| Σ_i Σ_t ℓ_{i,t} over the whole batch (DAPO token-level loss; TRL:3096-3099)
    if num_items is None:
        num_items = mask.sum()
    num_items = torch.as_tensor(num_items, dtype=mask.dtype, device=mask.device)
    return masked_loss.sum() / num_items.clamp(min=1.0)


@torch.no_grad()
def _metrics(ratio: Tensor, adv: Tensor, mask: Tensor, kl: Tensor | None, is_ratio: Tensor | None,
             cfg: GRPOConfig) -> dict[str, float]:
    """Detached diagnostics over this call's masked tokens, as Python floats."""
    tokens = mask.sum()

    def masked_mean(x: Tensor) -> float:  # TRL:3185 global_masked_mean, one process
        return float((x * mask).sum() / tokens.clamp(min=1.0))

    low = (ratio < 1 - cfg.epsilon_low) & (adv < 0)  # TRL:3200-3202
    high = (ratio > 1 + cfg.epsilon_high) & (adv > 0)
    nan = math.nan
    metrics = {
        "kl": masked_mean(kl) if kl is not None else nan,
        "clip_frac_low": masked_mean(low.to(mask.dtype)),
        "clip_frac_high": masked_mean(high.to(mask.dtype)),
        "clip_frac": masked_mean((low | high).to(mask.dtype)),
        "is_ratio_mean": nan, "is_ratio_min": nan, "is_ratio_max": nan,
        "tokens": float(tokens),
    }
    if is_ratio is not None:
        # Sequence weights count once per sequence, token weights over model tokens (TRL:2800-2803).
        flat = is_ratio.flatten() if is_ratio.shape[1] == 1 else is_ratio[mask.bool()]
        if flat.numel():
            metrics.update(is_ratio_mean=float(flat.mean()), is_ratio_min=float(flat.min()),
                           is_ratio_max=float(flat.max()))
    return metrics
