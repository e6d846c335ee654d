"""Model builds, offline and cached: small Qwen2 models built from scratch (tiny.py, with the shipped
default in shipped/) and registered pretrained models converted to Hugging Face format
(pretrained.py). `python -m artsg_nb.models NAME [DIR]` builds a registered model;
`python -m artsg_nb.models tiny DIR [--size 0.5b]` builds a tiny one;
`python -m artsg_nb.models random --shape 7b [DIR]` builds a benchmark model with random weights at
a real model's shape (random_model.py: for speed and memory, its rewards mean nothing)."""
