"""What a person looks at: training curves, sample tables and engine comparisons (plots/), and the
live dashboard (widgets/). Drawn from histories and DataFrames; nothing here changes a run."""
