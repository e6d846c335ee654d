"""The learning side of GRPO: the math (grpo.py, per-step statistics), the PEFT LoRA trainer and its
checkpoints, the trainer spread over ranks (distributed.py), what a run calls on either
(interface.py), publishing adapters to a server (lora.py) and exporting a trained adapter.

It knows nothing of runs, notebooks or tasks: it is handed token ids, logprobs and rewards."""
