"""GRPO math on numbers worked out by hand, micro-batch additivity, and the on-policy gradient.

TRL comparisons live in test_grpo_trl_oracle.py; this file needs only torch.
"""

import math

import pytest
import torch

from artsg_nb.rl.grpo import (
    GRPOConfig,
    compute_advantages,
    importance_sampling_ratio,
    policy_loss,
    zero_advantage_groups,
)

EPS = 1e-4  # added to the std, as TRL


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


# --------------------------------------------------------------------------------- advantages

def test_advantages_group_variable_sizes_and_degenerate_groups():
    # Groups interleaved, ids not contiguous: 7 → [1, 0], 2 → [0, 1, 2], 9 → [5] alone, 4 → [3, 3].
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 5.0, 3.0, 3.0])
    groups = torch.tensor([7, 2, 7, 2, 2, 9, 4, 4])
    # group 7: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = sqrt(0.5)
    # group 2: mean 1, std sqrt((1 + 0 + 1) / 2) = 1
    s7 = math.sqrt(0.5) + EPS
    expected = [0.5 / s7, -1 / (1 + EPS), -0.5 / s7, 0.0, 1 / (1 + EPS), 0.0, 0.0, 0.0]
    close(compute_advantages(rewards, groups, "group"), expected)


def test_advantages_batch_std_keeps_group_mean():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 1])
    # batch mean 0.8; squared deviations .04 + .64 + .64 + .04 + 1.44 = 2.8; unbiased var 2.8 / 4
    std = math.sqrt(0.7) + EPS
    centred = [0.5, -0.5, -1.0, 0.0, 1.0]  # rewards minus their *group* mean (0.5 and 1)
    close(compute_advantages(rewards, groups, "batch"), [c / std for c in centred])
    close(compute_advantages(rewards, groups, "none"), centred)


def test_identical_rewards_give_exact_zero_and_are_counted():
    # (0.9 + 0.9 + 0.9) / 3 != 0.9 in float32: the group must still get exact zeros, not the
    # ~6e-4 that (6e-8 off the mean) / (tiny std + 1e-4) would give.
    rewards = torch.tensor([0.9, 0.9, 0.9, 1.0, 0.0, 7.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    for mode in ("group", "batch", "none"):
        adv = compute_advantages(rewards, groups, mode)
        assert torch.equal(adv[[0, 1, 2, 5]], torch.zeros(4)), mode
        assert adv[3] > 0 > adv[4]
    assert zero_advantage_groups(rewards, groups) == 2  # group 0 and the lone group 2


def test_advantages_reject_nan_rewards():
    with pytest.raises(AssertionError, match="finite"):
        compute_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]), "group")


# --------------------------------------------------------------------------- importance ratio

def _is_inputs():
    old = torch.tensor([[0.0, -1.0, -2.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    sampling = torch.tensor([[0.0, -2.0, -1.0], [-1.5, -1.2, float("nan")], [float("nan"), -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    # Δ = old - sampling: row 0 [0, 1, -1]; row 1 [0.5, 0.2, 0 (masked NaN)]; row 2 [0 (NaN), 0, 0]
    return old, sampling, mask


@pytest.mark.parametrize("mode, expected", [
    ("token_truncate", [[1.0, 2.0, 0.5], [math.exp(0.5), math.exp(0.2), 1.0], [1.0, 1.0, 1.0]]),
    ("token_mask", [[1.0, 0.0, 0.0], [math.exp(0.5), math.exp(0.2), 1.0], [1.0, 1.0, 1.0]]),
    # sequence: exp(Σ Δ) = exp(0), exp(0.7) = 2.01 (> C_max = 2), exp(0)
    ("sequence_truncate", [[1.0], [2.0], [1.0]]),
    ("sequence_mask", [[1.0], [0.0], [1.0]]),
])
def test_importance_sampling_ratio_modes(mode, expected):
    cfg = GRPOConfig(is_mode=mode, is_clip_min=0.5, is_clip_max=2.0)
    ratio = importance_sampling_ratio(*_is_inputs(), cfg)
    assert not ratio.requires_grad
    close(ratio, expected)


def test_importance_sampling_ratio_one_sided_bounds():
    old, sampling, mask = _is_inputs()
    ratio = importance_sampling_ratio(old, sampling, mask, GRPOConfig(is_mode="token_truncate", is_clip_max=2.0))
    close(ratio[0], [1.0, 2.0, math.exp(-1)])  # no lower bound
    with pytest.raises(AssertionError, match="needs is_clip_min or is_clip_max"):
        GRPOConfig(is_mode="token_truncate", is_clip_min=None, is_clip_max=None)


# ------------------------------------------------------------------------------------- loss

def _two_by_three():
    """Ratios r = [[1, 1.5, 0.5], [0.7, 1.1, -]] with Â = [+1, -2]; last token of row 1 masked."""
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]], requires_grad=True)
    log_r = torch.log(torch.tensor([[1.0, 1.5, 0.5], [0.7, 1.1, 1.0]]))
    old = logps.detach() - log_r
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logps, old, torch.tensor([1.0, -2.0]), mask


# Per-token ℓ = -min(r Â, clip(r, 0.8, 1.28) Â):
#   row 0 (Â=+1): -1, -1.28 (clipped high), -0.5   → sum -2.78 over 3 tokens
#   row 1 (Â=-2): 2·max(0.7, 0.8) = 1.6 (clipped low), 2·1.1 = 2.2 → sum 3.8 over 2 tokens
@pytest.mark.parametrize("loss_type, expected", [
    ("grpo", (-2.78 / 3 + 3.8 / 2) / 2),
    ("dapo", (-2.78 + 3.8) / 5),
    ("dr_grpo", (-2.78 + 3.8) / (2 * 4)),
])
def test_loss_two_by_three(loss_type, expected):
    logps, old, adv, mask = _two_by_three()
    cfg = GRPOConfig(loss_type=loss_type, max_completion_length=4)
    loss, metrics = policy_loss(logps, old, adv, mask, cfg)
    close(loss, expected)
    assert metrics["clip_frac_low"] == pytest.approx(1 / 5)   # row 1 token 0
    assert metrics["clip_frac_high"] == pytest.approx(1 / 5)  # row 0 token 1
    assert metrics["clip_frac"] == pytest.approx(2 / 5)
    assert metrics["tokens"] == 5 and math.isnan(metrics["kl"]) and math.isnan(metrics["is_ratio_mean"])


def test_loss_two_by_three_gradient_dapo():
    # dℓ/dlogp = -Â r where the unclipped term is the min, 0 where the clipped one is; / 5 tokens.
    logps, old, adv, mask = _two_by_three()
    loss, _ = policy_loss(logps, old, adv, mask, GRPOConfig(loss_type="dapo"))
    loss.backward()
    close(logps.grad, [[-1.0 / 5, 0.0, -0.5 / 5], [0.0, 2.2 / 5, 0.0]])


def test_k3_kl_and_bias_correction_on_policy():
    # ref - logp = [ln 2, 0]; k3 = 2 - ln 2 - 1 and 0; Â = 0 so only β·KL is left; dapo / 2 tokens.
    logps = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    ref = logps.detach() + torch.tensor([[math.log(2), 0.0]])
    k3 = 1 - math.log(2)
    for correction, grad0 in [(False, 1 - 2), (True, (1 - 2) + k3)]:  # d/dlogp k3 = 1 - π_ref/π_θ; + k3·r'
        logps.grad = None
        cfg = GRPOConfig(beta=0.1, use_bias_correction_kl=correction)
        loss, metrics = policy_loss(logps, None, torch.zeros(1), torch.ones(1, 2), cfg, ref_logps=ref)
        loss.backward()
        close(loss, 0.1 * k3 / 2)
        close(metrics["kl"], k3 / 2)
        close(logps.grad, [[0.1 * grad0 / 2, 0.0]])


def test_is_ratio_multiplies_policy_term_only():
    logps = torch.tensor([[-1.0]], requires_grad=True)
    ref = logps.detach() + math.log(2)
    cfg = GRPOConfig(beta=0.1)
    loss, metrics = policy_loss(logps, None, torch.ones(1), torch.ones(1, 1), cfg, ref_logps=ref,
                                is_ratio=torch.tensor([[0.5]]))
    close(loss, -1 * 0.5 + 0.1 * (1 - math.log(2)))
    assert metrics["is_ratio_mean"] == metrics["is_ratio_min"] == metrics["is_ratio_max"] == 0.5


def test_epsilon_high_none_means_symmetric():
    assert GRPOConfig(epsilon_low=0.1, epsilon_high=None).epsilon_high == 0.1


# ------------------------------------------------------------------------------ micro-batches

def _random_batch(B=6, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 2, 5, 1, 6, 3])[:B]
    mask = (torch.arange(T) < lengths[:, None]).long()  # (B, T), right padding
    logps = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    old = logps.detach() + 0.3 * torch.randn(B, T, generator=g)
    ref = logps.detach() + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    is_ratio = torch.exp(0.2 * torch.randn(B, T, generator=g))
    return logps, old, adv, mask, ref, is_ratio


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batches_sum_to_full_batch(loss_type):
    logps, old, adv, mask, ref, is_ratio = _random_batch()
    cfg = GRPOConfig(loss_type=loss_type, beta=0.04, max_completion_length=7)
    full, _ = policy_loss(logps, old, adv, mask, cfg, ref_logps=ref, is_ratio=is_ratio)
    (full_grad,) = torch.autograd.grad(full, logps)

    total = torch.zeros(())
    for rows in (slice(0, 2), slice(2, 6)):
        T = int(mask[rows].sum(-1).max())  # each micro-batch trimmed to its own longest sequence
        part, _ = policy_loss(logps[rows, :T], old[rows, :T], adv[rows], mask[rows, :T], cfg,
                              ref_logps=ref[rows, :T], is_ratio=is_ratio[rows, :T],
                              num_sequences=6, num_items=mask.sum())
        total = total + part
    (micro_grad,) = torch.autograd.grad(total, logps)
    close(total, full)
    close(micro_grad, full_grad)


# --------------------------------------------------------------------------------- on-policy

@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_on_policy_gradient_is_reinforce(loss_type):
    """With π_old = π_θ the ratio is 1, nothing clips, and ∇ loss = -Σ w_{i,t} Â_i ∇ log π_θ."""
    g = torch.Generator().manual_seed(1)
    B, T, V = 4, 5, 11
    theta = torch.randn(B, T, V, generator=g, requires_grad=True)  # a "model": free logits
    tokens = torch.randint(V, (B, T), generator=g)
    mask = (torch.arange(T) < torch.tensor([5, 3, 1, 4])[:, None]).long()
    adv = torch.randn(B, generator=g)
    logps = torch.log_softmax(theta, -1).gather(-1, tokens[..., None]).squeeze(-1)  # (B, T)

    cfg = GRPOConfig(loss_type=loss_type, max_completion_length=T)
    loss, metrics = policy_loss(logps, None, adv, mask, cfg)
    (grad,) = torch.autograd.grad(loss, theta, retain_graph=True)

    # REINFORCE surrogate with the same per-token weights w as the loss type.
    weights = {"grpo": mask / mask.sum(-1, keepdim=True) / B,
               "dr_grpo": mask / (B * T),
               "dapo": mask / mask.sum()}[loss_type]
    reinforce = -(weights * adv[:, None] * logps).sum()
    (expected,) = torch.autograd.grad(reinforce, theta)
    close(grad, expected)
    assert metrics["clip_frac"] == 0.0
