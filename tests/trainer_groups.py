"""Made-up trajectory groups for trainer tests: token ids, a completion mask, sampling logprobs and
a reward per trajectory, as rollout groups give them to Trainer.train_step."""
from types import SimpleNamespace

import torch


def traj(ids, n_prompt, reward, logp=-2.0):
    mask = [0] * n_prompt + [1] * (len(ids) - n_prompt)
    return SimpleNamespace(token_ids=ids, completion_mask=mask, logprobs=[logp if m else 0.0 for m in mask],
                           reward=reward, error=None)


def groups(seed=0, vocab=50):
    """Two groups of four trajectories (3-6 completion tokens, rewards 0 and 1 alternating)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        prompt = torch.randint(5, vocab, (6,), generator=g).tolist()
        trajs = [traj(prompt + torch.randint(5, vocab, (3 + i,), generator=g).tolist(), 6, float(i % 2))
                 for i in range(4)]
        out.append(SimpleNamespace(trajectories=trajs))
    return out
