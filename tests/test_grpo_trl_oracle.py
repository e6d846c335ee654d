"""artsg_nb.rl.grpo against TRL 1.15.0's own code, on the same tensors.

- Loss and d(loss)/d(logps): TRL's `GRPOTrainer._compute_loss` on a bare instance
  (`object.__new__(GRPOTrainer)` with the attributes it reads; our logps injected through
  `_get_per_token_logps_and_entropies`), the pattern of TRL's tests/test_grpo_trainer.py.
- Advantages and the IS ratio: `_generate_and_score_completions` of a real GRPOTrainer on a
  tiny random Qwen2 with a WordLevel tokenizer (built in a temp dir, no hub), with `_generate`
  stubbed to return fixed completions, server logprobs and rewards (a dataset column).

The attribute names are TRL internals: if TRL is upgraded and a test errors with an
AttributeError, re-read `_compute_loss` / `_generate_and_score_completions`; that is not a
loss bug. Never import unsloth here: it rebinds TRL's trainers.
"""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import trl

from trl import GRPOTrainer

from artsg_nb.rl.grpo import GRPOConfig, compute_advantages, importance_sampling_ratio, policy_loss

assert trl.__version__.startswith(("1.15.", "1.16.")), f"oracle read against TRL 1.15/1.16, not {trl.__version__}"

TOL = 1e-6
CLIP_MIN, CLIP_MAX = 0.5, 2.0  # IS bounds narrow enough that the random batch hits both


def assert_close(actual, expected, what):
    diff = (torch.as_tensor(actual, dtype=torch.float64) - torch.as_tensor(expected, dtype=torch.float64)).abs()
    assert diff.max() <= TOL, f"{what}: max |ours - TRL| = {diff.max():.3g} > {TOL}"


# ------------------------------------------------------------------------- loss (Recipe B)

def random_batch(B=8, T=10, seed=0):
    """Right-padded completions of different lengths, with old, ref and server logprobs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([10, 3, 7, 1, 9, 5, 10, 2])[:B]
    mask = (torch.arange(T) < lengths[:, None]).long()  # (B, T)
    logps = -torch.rand(B, T, generator=g) * 4  # (B, T), log π_θ
    old = logps + 0.25 * torch.randn(B, T, generator=g)  # enough drift that both clip sides trigger
    ref = logps + 0.3 * torch.randn(B, T, generator=g)
    sampling = old + 0.4 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    return dict(logps=logps, old=old, ref=ref, sampling=sampling, adv=adv, mask=mask)


def bare_trl_trainer(cfg: GRPOConfig, logps: torch.Tensor, use_is: bool) -> GRPOTrainer:
    """A GRPOTrainer with only what `_compute_loss` reads (TRL 1.15.0 grpo_trainer.py:2946-3209)."""
    t = object.__new__(GRPOTrainer)
    t.loss_type, t.beta = cfg.loss_type, cfg.beta
    t.epsilon_low, t.epsilon_high = cfg.epsilon_low, cfg.epsilon_high
    t.max_completion_length = cfg.max_completion_length
    t.importance_sampling_level, t.top_entropy_quantile, t.off_policy_mask_threshold = "token", 1.0, None
    t.use_vllm = t.vllm_importance_sampling_correction = use_is
    t.aux_loss_enabled = t._entropy_bonus_enabled = False
    t.current_gradient_accumulation_steps = 1
    t.args = SimpleNamespace(use_bias_correction_kl=cfg.use_bias_correction_kl, delta=None, steps_per_generation=1)
    t.model = SimpleNamespace(training=True)
    t.accelerator = SimpleNamespace(num_processes=1, reduce=lambda x, reduction="sum": x, gather=lambda x: x)
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    return t


def trl_loss(cfg, b, is_ratio):
    """TRL's loss, gradient w.r.t. the injected logps, and its logged metrics."""
    logps = b["logps"].clone().requires_grad_()
    t = bare_trl_trainer(cfg, logps, use_is=is_ratio is not None)
    B, T = b["mask"].shape
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": b["mask"],
        "advantages": b["adv"], "old_per_token_logps": b["old"], "num_items_in_batch": b["mask"].sum(),
    }
    if cfg.beta != 0.0:
        inputs["ref_per_token_logps"] = b["ref"]
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = GRPOTrainer._compute_loss(t, None, inputs)
    (grad,) = torch.autograd.grad(loss, logps)
    return loss.detach(), grad, {k: v[-1] for k, v in t._metrics["train"].items()}


def our_loss(cfg, b, is_ratio):
    logps = b["logps"].clone().requires_grad_()
    ref = b["ref"] if cfg.beta != 0.0 else None
    loss, metrics = policy_loss(logps, b["old"], b["adv"], b["mask"], cfg, ref_logps=ref, is_ratio=is_ratio)
    (grad,) = torch.autograd.grad(loss, logps)
    return loss.detach(), grad, metrics


KL_CASES = {"no_kl": dict(beta=0.0), "kl_bias_corrected": dict(beta=0.04, use_bias_correction_kl=True),
            "kl_plain": dict(beta=0.04, use_bias_correction_kl=False)}


@pytest.mark.parametrize("is_mode", [None, "token_truncate", "sequence_mask"])
@pytest.mark.parametrize("kl", list(KL_CASES))
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_loss_and_gradient_match_trl(loss_type, kl, is_mode):
    cfg = GRPOConfig(loss_type=loss_type, max_completion_length=12, is_mode=is_mode,
                     is_clip_min=CLIP_MIN, is_clip_max=CLIP_MAX, **KL_CASES[kl])
    b = random_batch()
    is_ratio = None if is_mode is None else importance_sampling_ratio(b["old"], b["sampling"], b["mask"], cfg)
    if is_mode == "token_truncate":  # the case is only a test if the bounds bite
        assert ((is_ratio == CLIP_MIN) | (is_ratio == CLIP_MAX))[b["mask"].bool()].any()
    if is_mode == "sequence_mask":
        assert (is_ratio == 0).any() and (is_ratio != 0).any()

    loss, grad, metrics = our_loss(cfg, b, is_ratio)
    trl_value, trl_grad, trl_metrics = trl_loss(cfg, b, is_ratio)
    assert_close(loss, trl_value, "loss")
    assert_close(grad, trl_grad, "d loss / d logps")
    assert trl_metrics["clip_ratio/low_mean"] > 0 and trl_metrics["clip_ratio/high_mean"] > 0
    for ours, theirs in [("clip_frac_low", "clip_ratio/low_mean"), ("clip_frac_high", "clip_ratio/high_mean"),
                         ("clip_frac", "clip_ratio/region_mean")] + ([("kl", "kl")] if cfg.beta else []):
        assert_close(metrics[ours], trl_metrics[theirs], ours)


# ----------------------------------------------------- advantages and IS ratio (Recipes C/D)

G = 4  # TRL's fixed group size; smaller groups are padded with None rewards (unscorable → NaN)


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    """A real GRPOTrainer on a tiny random Qwen2; its `_generate` is stubbed by each test."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from trl import GRPOConfig as TRLConfig

    model_dir = tmp_path_factory.mktemp("tiny_qwen2")
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(30)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    tokenizer.save_pretrained(model_dir)
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, pad_token_id=0,
                                 bos_token_id=1, eos_token_id=1)).save_pretrained(model_dir)

    def reward_from_column(completions, reward, **kwargs):  # the dataset column "reward", None allowed
        return reward

    args = TRLConfig(output_dir=str(model_dir / "out"), use_cpu=True, num_generations=G,
                     per_device_train_batch_size=G, max_completion_length=12, report_to="none")
    dataset = Dataset.from_dict({"prompt": ["w1 w2"] * G, "reward": [0.0] * G})
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[reward_from_column], args=args,
                          train_dataset=dataset, processing_class=tokenizer)
    trainer.model.train()  # from_pretrained leaves eval mode; TRL branches on it (metrics, group size)
    return trainer


def run_trl_scoring(trainer, rewards, completion_ids, sampling_logps):
    """TRL's `_generate_and_score_completions` on fixed completions; returns its output dict."""
    B = len(rewards)
    trainer._generate = lambda prompts: ([[2, 3]] * B, completion_ids, None, ["w3"] * B, sampling_logps,
                                         {}, None, [])
    return trainer._generate_and_score_completions([{"prompt": "w1 w2", "reward": r} for r in rewards])


# Groups of G slots: sizes 3, 4 (identical), 4, 1, 2, 4 (random), as seen by compute_advantages.
REWARDS = [1.0, 0.0, 0.5, None,  2.0, 2.0, 2.0, 2.0,  0.3, -1.2, 0.7, 2.5,
           3.0, None, None, None,  None, 0.25, None, -0.75] + torch.randn(
    G, generator=torch.Generator().manual_seed(3)).tolist()


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_match_trl(trl_trainer, scale_rewards):
    trl_trainer.scale_rewards = scale_rewards
    trl_trainer.use_vllm = trl_trainer.vllm_importance_sampling_correction = False
    out = run_trl_scoring(trl_trainer, REWARDS, [[3, 1]] * len(REWARDS), [[-1.0, -1.0]] * len(REWARDS))

    kept = [i for i, r in enumerate(REWARDS) if r is not None]  # our rollouts: failed ones dropped
    rewards = torch.tensor([REWARDS[i] for i in kept])
    group_ids = torch.tensor([i // G for i in kept])
    ours = compute_advantages(rewards, group_ids, scale_rewards)
    assert_close(ours, out["advantages"][kept], f"advantages ({scale_rewards})")
    assert (ours != 0).sum() >= 10


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_is_ratio_matches_trl(trl_trainer, mode):
    g = torch.Generator().manual_seed(7)
    lengths = [6, 2, 5, 1, 6, 4, 3, 6]
    B, T = len(lengths), max(lengths)
    completion_ids = [[3] * (n - 1) + [1] for n in lengths]
    old = -torch.rand(B, T, generator=g) * 3  # the trainer's log π_old, injected
    sampling = [(old[i, :n] + 0.4 * torch.randn(n, generator=g)).tolist() for i, n in enumerate(lengths)]
    sampling[2][1] = None  # a token the server could not score → NaN → no correction

    trl_trainer.use_vllm = trl_trainer.vllm_importance_sampling_correction = True
    trl_trainer.vllm_importance_sampling_mode = mode
    trl_trainer.vllm_importance_sampling_clip_min = CLIP_MIN
    trl_trainer.vllm_importance_sampling_clip_max = CLIP_MAX
    trl_trainer._get_per_token_logps_and_entropies = lambda *a, **k: (old, None, None)
    try:
        out = run_trl_scoring(trl_trainer, [0.0, 1.0, 0.5, 0.2] * 2, completion_ids, sampling)
    finally:
        del trl_trainer._get_per_token_logps_and_entropies  # back to the real method
        trl_trainer.use_vllm = trl_trainer.vllm_importance_sampling_correction = False

    cfg = GRPOConfig(is_mode=mode, is_clip_min=CLIP_MIN, is_clip_max=CLIP_MAX)
    ours = importance_sampling_ratio(out["old_per_token_logps"], out["sampling_per_token_logps"],
                                     out["completion_mask"], cfg)
    theirs = out["importance_sampling_ratio"]
    assert ours.shape == theirs.shape
    assert_close(ours, theirs, f"IS ratio ({mode})")
    # The IS metrics policy_loss reports are TRL's sampling/importance_sampling_ratio/{mean,min,max}.
    _, metrics = policy_loss(old, None, torch.zeros(B), out["completion_mask"], cfg, is_ratio=ours)
    for stat in ("mean", "min", "max"):
        trl_stat = trl_trainer._metrics["train"][f"sampling/importance_sampling_ratio/{stat}"][-1]
        assert math.isclose(metrics[f"is_ratio_{stat}"], trl_stat, abs_tol=TOL), stat
