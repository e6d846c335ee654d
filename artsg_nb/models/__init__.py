"""Model builds, offline and cached: small Qwen2 models built from scratch (tiny.py, with the shipped
default in shipped/) and registered pretrained models converted to Hugging Face format
(pretrained.py). `python -m artsg_nb.models NAME [DIR]` builds a registered model;
`python -m artsg_nb.models tiny DIR [--size 0.5b]` builds a tiny one."""
