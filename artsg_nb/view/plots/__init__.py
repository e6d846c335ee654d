"""Training curves, samples and engine-comparison charts, drawn from pandas DataFrames.

panels.py: one `plot_*(df, ax=None)` per History column family, and which panels say something;
training.py: the grid (`plot_training`), live redraws in the running cell (`LivePlot`,
`LiveTraining` with its ETA bar), several runs on one figure (`compare_runs`); samples.py: the
rollouts files and history read for them, and `sample_table` (a step's completions);
sample_cards.py: samples read whole (`sample_cards`, the table behind `run.samples()`);
bench.py: `plot_engine_comparison`, `plot_turn_hit_rates`. Every chart accepts empty frames,
missing columns and NaN values ("no data" instead of raising); nothing here computes metrics or
writes anything but an image file asked for.
"""

from .bench import ENGINE_COLORS, SCHEDULE_COLORS, plot_engine_comparison, plot_turn_hit_rates
from .common import figure_png, new_figure
from .panels import (plot_clip_frac, plot_completion_length, plot_grad_norm, plot_hit_rate, plot_is_ratio,
                     plot_kl, plot_loss, plot_reload_time, plot_reward, plot_reward_parts, plot_step_times, plot_tokens_per_s,
                     training_panels)
from .sample_cards import sample_cards
from .samples import load_rollouts, read_history, sample_table
from .step import plot_step_benchmark
from .training import LivePlot, LiveTraining, compare_runs, plot_training, save_training_plot

__all__ = ["plot_step_benchmark", "ENGINE_COLORS", "SCHEDULE_COLORS", "LivePlot", "LiveTraining", "compare_runs", "figure_png",
           "load_rollouts", "new_figure", "plot_clip_frac", "plot_completion_length", "plot_engine_comparison",
           "plot_grad_norm", "plot_hit_rate", "plot_is_ratio", "plot_kl", "plot_loss", "plot_reload_time",
           "plot_reward", "plot_reward_parts", "plot_step_times", "plot_tokens_per_s", "plot_training", "plot_turn_hit_rates",
           "read_history", "sample_cards", "sample_table", "save_training_plot", "training_panels"]
