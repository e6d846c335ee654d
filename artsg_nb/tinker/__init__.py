"""A Tinker-compatible API on the local runtime: the `tinker` client, and recipes written for it
(tinker-cookbook's RL loop), train and sample against one local GPU — or the CPU engine.

    from artsg_nb.tinker import TinkerServer, TinkerService
    trainer = MultiTrainer(model_path, lora=LoraSpec(rank=16), max_grad_norm=math.inf)
    service = TinkerService(trainer, server.client(), base_model=model_path, root="runs/tinker")
    with TinkerServer(service) as srv:          # 127.0.0.1, a random API key
        client = tinker.ServiceClient(base_url=srv.base_url, api_key=srv.api_key)

Supported: create_lora_training_client, forward_backward (loss_fn "cross_entropy" or
"importance_sampling"), forward, forward_backward_custom (client-side), optim_step (AdamParams),
save_weights_for_sampler, save_weights_and_get_sampling_client, save_state (the adapter, without optimizer state),
create_sampling_client (model_path or base_model), sample (num_samples, max_tokens, temperature,
top_p, stop, seed, prompt logprobs), compute_logprobs, get_info, get_tokenizer. Everything else
answers an error that names what is supported. service.py, server.py and wire.py say how.

`python -m artsg_nb.tinker --model PATH` starts all three (__main__.py); the client's RL loop, as
tinker-cookbook writes it, is rl_loop.py.

What it does not do: train or sample by itself — the trainer (multi.MultiTrainer, backend.Trainer)
and the inference server (SGLang, or the CPU engine) do. Importing it imports torch (the
trainer's data types) but not `tinker`, which only its protobuf bodies need.
"""
from .backend import LOSS_FUNCTIONS, LoraRequest, Sampler, Trainer
from .server import TinkerServer, make_app
from .service import TinkerService

__all__ = ["LOSS_FUNCTIONS", "LoraRequest", "Sampler", "TinkerServer", "TinkerService", "Trainer", "make_app"]
