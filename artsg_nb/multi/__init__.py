"""Several experiments on one base model and one inference server: a sweep on one GPU.

`MultiTrainer` (trainer.py) holds the base model once with one LoRA adapter and one optimizer per
experiment; `Sweep` (runtime.py) runs N GRPO experiments on it and one server, their rollouts
batched together, their updates time-shared. It knows nothing of notebooks' widgets beyond the
plots it draws with view/."""
