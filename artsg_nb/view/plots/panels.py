"""One training panel per function: `plot_*(df, ax=None)` draws one family of History columns.

Panels: reward (mean with its distribution: per-sample box plots from the rollouts files when
given, else a ±1 std band; eval reward when an `eval_reward` column has values), each reward
function's mean (one line per `rewards/<fn>/mean` column, dataset tasks), loss, KL,
completion length, generated tokens per second, the step's time split into rollout / train /
reload (stacked), clip fraction, gradient norm, IS ratio and prefix-cache hit rate.
`training_panels(df)` picks the ones that say something: KL only when a KL term was computed
(beta > 0), the IS ratio only when it left 1 ± IS_FLAT_TOLERANCE, the clip fraction only once
something was clipped. Every panel accepts empty
frames, missing columns and NaN values ("no data" instead of raising). Nothing here reads files.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.axes import Axes

from .common import axes_for, column, has_data, no_data, plot_line, ratio_column

IS_FLAT_TOLERANCE = 0.02
"""An IS ratio whose whole min–max band stays within 1 ± this is on-policy: its panel is dropped."""
STEP_TIME_PARTS = (("rollout_s", "rollout", "tab:blue"), ("train_s", "train", "tab:orange"),
                   ("reload_s", "reload", "tab:brown"), ("release_s", "release", "tab:gray"),
                   ("resume_s", "resume", "tab:olive"))


def plot_reward(df: pd.DataFrame, ax: Axes | None = None, samples: pd.DataFrame | None = None) -> Axes:
    """Mean reward per step with its spread: box plots of the per-sample rewards when `samples`
    (step, reward rows from the rollouts files) has any, else a ±1 std band; eval reward dashed."""
    ax = axes_for(ax, "reward", "reward")
    step, mean = column(df, "reward_mean")
    if not has_data(mean):
        return no_data(ax)
    ax.plot(step, mean, marker=".", color="tab:blue", label="mean", zorder=3)
    per_step = _rewards_by_step(samples, step)
    if per_step:
        positions = list(per_step)
        ax.boxplot(list(per_step.values()), positions=positions, widths=0.5, manage_ticks=False,
                   showfliers=False, patch_artist=True,
                   boxprops=dict(facecolor="tab:blue", alpha=0.25, edgecolor="tab:blue"),
                   medianprops=dict(color="tab:blue"), whiskerprops=dict(color="tab:blue"),
                   capprops=dict(color="tab:blue"))
        ax.fill_between([], [], [], color="tab:blue", alpha=0.25, label="samples (box)")
    else:
        _, std = column(df, "reward_std")
        if has_data(std):
            ax.fill_between(step, mean - std, mean + std, color="tab:blue", alpha=0.2, label="± std")
    _, evaluation = column(df, "eval_reward")
    if has_data(evaluation):
        ok = np.isfinite(evaluation)
        ax.plot(step[ok], evaluation[ok], "s--", color="tab:green", label="eval")
    ax.legend(loc="lower right", fontsize="x-small")
    return ax


def reward_part_columns(df: pd.DataFrame | None) -> dict[str, str]:
    """{function name: its `rewards/<fn>/mean` column} for the columns of `df` with values."""
    if df is None:
        return {}
    found = {c[len("rewards/"):-len("/mean")]: c for c in df.columns
             if isinstance(c, str) and c.startswith("rewards/") and c.endswith("/mean")}
    return {name: c for name, c in found.items() if has_data(pd.to_numeric(df[c], errors="coerce").to_numpy(float))}


def plot_reward_parts(df: pd.DataFrame, ax: Axes | None = None) -> Axes:
    """Each reward function's mean per step, one line each (history's `rewards/<fn>/mean`, as
    TRL logs them), before weighting: which part of the reward moves."""
    ax = axes_for(ax, "reward functions", "mean value")
    parts = reward_part_columns(df)
    if not parts:
        return no_data(ax, "one reward (no reward functions)")
    step = pd.to_numeric(df["step"], errors="coerce").to_numpy(float)
    for name, c in parts.items():
        values = pd.to_numeric(df[c], errors="coerce").to_numpy(float)
        ok = np.isfinite(values)
        ax.plot(step[ok], values[ok], marker=".", label=name)
    ax.legend(loc="lower right", fontsize="x-small")
    return ax


def plot_loss(df: pd.DataFrame, ax: Axes | None = None) -> Axes:
    """Policy loss per step."""
    return plot_line(df, "loss", axes_for(ax, "loss", "loss"), color="tab:red")


def plot_kl(df: pd.DataFrame, ax: Axes | None = None) -> Axes:
    """KL to the reference (adapter-disabled) model per step; NaN when beta = 0."""
    ax = axes_for(ax, "KL", "kl")
    step, kl = column(df, "kl")
    if len(kl) and not has_data(kl):  # the column is there, every value is null
        pad = max(step.max() - step.min(), 1) * 0.05  # the same steps as the panels beside it
        ax.set_xlim(step.min() - pad, step.max() + pad)
        ax.set_yticks([])
        return no_data(ax, "no KL term (beta = 0)")
    return plot_line(df, "kl", ax, color="tab:purple")


def plot_is_ratio(df: pd.DataFrame, ax: Axes | None = None) -> Axes:
    """Importance-sampling ratio trainer/server: mean with a min–max band, 1.0 dotted."""
    ax = axes_for(ax, "IS ratio (trainer / server)", "ratio")
    step, mean = ratio_column(df, "mean")
    if not has_data(mean):
        return no_data(ax)
    ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    ax.plot(step, mean, marker=".", color="tab:green", label="mean")
    _, low = ratio_column(df, "min")
    _, high = ratio_column(df, "max")
    if has_data(low) and has_data(high):
        ax.fill_between(step, low, high, color="tab:green", alpha=0.2, label="min–max")
    if "is_raw_ratio_max" in df:  # grpo's is_ratio_max: the largest weight applied (after the cap)
        w_step, applied = column(df, "is_ratio_max")
        if has_data(applied):
            ax.plot(w_step, applied, color="tab:red", linestyle="--", linewidth=1, label="max weight applied")
    lo, hi = ax.get_ylim()
    ax.set_ylim(min(lo, 0.95), max(hi, 1.05))
    ax.ticklabel_format(axis="y", useOffset=False)
    return ax


def plot_hit_rate(df: pd.DataFrame, ax: Axes | None = None, theoretical: float | None = None) -> Axes:
    """Prefix-cache hit rate of each step (bars, labelled) beside what its submission path can reach
    (history's hit_rate_reachable, a black tick over each bar; a grey one above it where the cache
    could also share a prefix across groups, hit_rate_shared), and why, when the path reaches
    nothing (copies prefilled together). Histories written before those columns fall back to
    theoretical_hit_rate; `theoretical` draws one value as a line instead.

    Each step serves a new adapter, and the cache is keyed by adapter, so the rate is per step.
    """
    ax = axes_for(ax, "prefix-cache hit rate per step", "hit rate")
    step, rate = column(df, "hit_rate")
    _, reach = column(df, "hit_rate_reachable")
    label = "reachable"
    if not has_data(reach):
        _, reach = column(df, "theoretical_hit_rate")
        label = "theoretical"
    if theoretical is None and has_data(reach):
        ok = np.isfinite(reach)
        ax.hlines(reach[ok], step[ok] - 0.3, step[ok] + 0.3, colors="black", linestyles="--", linewidth=1,
                  label=label, zorder=3)
        _draw_shared(df, ax, step, reach)
        ax.legend(loc="lower right", fontsize="x-small")
    elif theoretical is not None and np.isfinite(theoretical):
        ax.axhline(theoretical, color="black", linestyle="--", linewidth=1,
                   label=f"theoretical {theoretical:.2f}")
        ax.legend(loc="lower right", fontsize="x-small")
    _explain_path(df, ax)
    if not has_data(rate):
        return no_data(ax)
    ok = np.isfinite(rate)
    bars = ax.bar(step[ok], rate[ok], width=0.6, color="tab:cyan")
    if ok.sum() <= 12:  # labels stay readable up to about a dozen bars
        ax.bar_label(bars, fmt="%.2f", fontsize="x-small", padding=1)
    ax.plot(step, rate, color="tab:cyan", linewidth=0)  # a Line2D too, for code that reads .lines
    lists = [r if isinstance(r, list) else [] for r in df["worker_hit_rates"]] if "worker_hit_rates" in df else []
    if any(lists):  # several servers (RunConfig.num_servers): a thin line per worker
        per = pd.DataFrame(lists, dtype=float)
        for w in per:
            ax.plot(step, per[w].to_numpy(), linewidth=0.8, alpha=0.8, label=f"worker {w}")
        ax.legend(loc="lower right", fontsize="x-small")
    ax.set_ylim(0, 1.12)
    return ax


SHARED_TICK_FROM = 0.01
"""A cross-group share (hit_rate_shared) below this is not drawn."""


def _draw_shared(df: pd.DataFrame, ax: Axes, step: np.ndarray, reach: np.ndarray) -> None:
    _, shared = column(df, "hit_rate_shared")
    if not has_data(shared):
        return
    top = reach + np.nan_to_num(shared)
    ok = np.isfinite(top) & (np.nan_to_num(shared) >= SHARED_TICK_FROM)
    if ok.any():
        ax.hlines(top[ok], step[ok] - 0.3, step[ok] + 0.3, colors="grey", linestyles=":", linewidth=1,
                  label="+ shared across groups", zorder=3)


def _explain_path(df: pd.DataFrame, ax: Axes) -> None:
    """Say on the panel why the last step's path reaches nothing, when it does."""
    if "hit_rate_path" not in df or df["hit_rate_path"].dropna().empty:
        return
    path = str(df["hit_rate_path"].dropna().iloc[-1])
    if "KV short" in path:
        ax.text(0.02, 0.97, "the step needs more KV cache than the server holds:\nprompts evicted before "
                "every copy reads them (fewer/shorter samples,\nor release_memory=True)", transform=ax.transAxes,
                va="top", fontsize="x-small", color="dimgray")
    elif path.startswith("prefilled together"):
        ax.text(0.02, 0.97, "copies prefilled together: nothing to reuse\n(faster at this size; "
                "prompt_warm_up='always' caches first)", transform=ax.transAxes, va="top", fontsize="x-small",
                color="dimgray")
    else:
        ax.text(0.02, 0.97, path, transform=ax.transAxes, va="top", fontsize="x-small", color="dimgray")


def plot_reload_time(df: pd.DataFrame, ax: Axes | None = None) -> Axes:
    """Seconds to save the adapter and load it into the server, per step."""
    return plot_line(df, "reload_s", axes_for(ax, "adapter reload", "seconds"), color="tab:brown")


def plot_completion_length(df: pd.DataFrame, ax: Axes | None = None,
                           samples: pd.DataFrame | None = None) -> Axes:
    """Mean completion length in tokens per step (min–max band from the rollouts files)."""
    ax = axes_for(ax, "completion length", "tokens / sample")
    step, length = _completion_length(df)
    if not has_data(length):
        return no_data(ax)
    ax.plot(step, length, marker=".", color="tab:pink")
    if samples is not None and len(samples) and {"step", "completion_tokens"} <= set(samples):
        tokens = pd.to_numeric(samples["completion_tokens"], errors="coerce")
        spread = tokens.groupby(pd.to_numeric(samples["step"], errors="coerce")).agg(["min", "max"]).dropna()
        if len(spread):
            ax.fill_between(spread.index.to_numpy(float), spread["min"].to_numpy(float),
                            spread["max"].to_numpy(float), color="tab:pink", alpha=0.2)
    return ax


def plot_tokens_per_s(df: pd.DataFrame, ax: Axes | None = None) -> Axes:
    """Generated (completion) tokens per second of rollout time, per step."""
    ax = axes_for(ax, "generation throughput", "tokens / s")
    step, tokens = column(df, "completion_tokens")
    _, rollout_s = column(df, "rollout_s")
    if not (has_data(tokens) and has_data(rollout_s)):
        return no_data(ax)
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = np.where(rollout_s > 0, tokens / rollout_s, np.nan)
    return plot_line(pd.DataFrame({"step": step, "rate": rate}), "rate", ax, color="tab:olive")


def plot_step_times(df: pd.DataFrame, ax: Axes | None = None) -> Axes:
    """Where each step's time went: rollout / train / reload (and memory release / resume)
    seconds as stacked bars."""
    ax = axes_for(ax, "step time", "seconds")
    bottom = None
    for name, label, color in STEP_TIME_PARTS:
        step, seconds = column(df, name)
        if not has_data(seconds):
            continue
        seconds = np.nan_to_num(seconds)
        bottom = np.zeros_like(seconds) if bottom is None else bottom
        ax.bar(step, seconds, width=0.6, bottom=bottom, color=color, label=label)
        bottom = bottom + seconds
    if bottom is None:
        return no_data(ax)
    ax.legend(loc="upper left", fontsize="x-small", ncol=3)
    ax.margins(y=0.25)  # room for the legend above the bars
    return ax


def plot_clip_frac(df: pd.DataFrame, ax: Axes | None = None) -> Axes:
    """Fraction of tokens whose ratio the PPO clip cut off, per step."""
    return plot_line(df, "clip_frac", axes_for(ax, "clip fraction", "fraction"), color="tab:gray")


def plot_grad_norm(df: pd.DataFrame, ax: Axes | None = None) -> Axes:
    """Gradient norm of the LoRA weights before clipping, per step."""
    return plot_line(df, "grad_norm", axes_for(ax, "grad norm", "norm"), color="tab:red")


def training_panels(df: pd.DataFrame | None) -> list[str]:
    """The panels worth their space for `df`, in drawing order (names of the plot_* functions
    without the prefix): KL only with a KL term, the IS ratio only when it moved off 1, the clip
    fraction only when it is not all zeros, the reward functions only when the rows have them."""
    names = ["reward", *(["reward_parts"] if reward_part_columns(df) else []), "loss", "completion_length", "tokens_per_s", "step_times", "hit_rate",
             "clip_frac", "grad_norm"]
    _, clipped = column(df, "clip_frac")
    if has_data(clipped) and np.nanmax(np.abs(clipped)) == 0:  # one update per batch: never clipped
        names.remove("clip_frac")
    _, kl = column(df, "kl")
    if has_data(kl):
        names.insert(2, "kl")
    _, low = ratio_column(df, "min")
    _, high = ratio_column(df, "max")
    if has_data(low) and has_data(high) and (
            np.nanmax(np.abs(np.concatenate([low, high]) - 1.0)) > IS_FLAT_TOLERANCE):
        names.append("is_ratio")
    return names


def _completion_length(df: pd.DataFrame | None) -> tuple[np.ndarray, np.ndarray]:
    """Mean completion tokens per sample: completion_tokens / samples (history columns)."""
    step, tokens = column(df, "completion_tokens")
    _, samples = column(df, "samples")
    if not (has_data(tokens) and has_data(samples)):
        return step, np.full(len(step), np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        return step, np.where(samples > 0, tokens / samples, np.nan)


def _rewards_by_step(samples: pd.DataFrame | None, steps: np.ndarray) -> dict[float, np.ndarray]:
    """{step: rewards of its samples} for the steps in `steps` with at least one finite reward."""
    if samples is None or len(samples) == 0 or not {"step", "reward"} <= set(samples):
        return {}
    wanted = set(steps.tolist())
    out = {}
    for step, rewards in samples.groupby("step")["reward"]:
        values = pd.to_numeric(rewards, errors="coerce").to_numpy(float)
        values = values[np.isfinite(values)]
        if float(step) in wanted and len(values):
            out[float(step)] = values
    return out
