"""The CPU engine: a separate server program, a CPU stand-in for SGLang's native HTTP API.

    python -m artsg_nb.cpu_engine --model-path DIR --host 127.0.0.1 --port 30000 [...]

It is started and stopped exactly like SGLang (a subprocess in its own process group, ready
once /health answers 200 and the log says "The server is fired up and ready to roll!", stopped
by SIGTERM to the group), so the toolkit runs one code path on a laptop or in CI and on a GPU
box. It serves a transformers causal LM (float32, CPU) with PEFT LoRA adapters loaded and
unloaded by name at runtime, behind SGLang's routes, JSON shapes, status codes and metric names
(/health, /generate, /v1/chat/completions, /load_lora_adapter, /unload_lora_adapter,
/flush_cache, /release_memory_occupation, /resume_memory_occupation, /metrics, /model_info,
/server_info, /v1/models). Prefixes are reused through a token-level radix cache of real KV
tensors, namespaced per adapter load id exactly as SGLang keys its cache: reuse within a policy
version, never across versions.

The modules, from the outside in: `__main__` (command line) → `routes` (FastAPI handlers) →
`engine` (Engine: adapter registry, memory release/resume, asyncio ↔ scheduler bridge) and
`protocol` (JSON ↔ requests) → `scheduler` (one thread that owns the model: FCFS queue,
continuous batching, adapters mixed per batch, one prefill at a time with radix reuse) →
`batch` (the left-padded running batch) → `model` (transformers + PEFT forward) and
`radix_cache`. `request` is the unit of work they pass around, `sampling` the sampling_params
contract and the sampler, `metrics` the Prometheus registry, `memory` the release/resume state.

What it deliberately is not: part of the training side. The package imports nothing from the
rest of artsg_nb (tests/cpu_engine/test_cpu_engine_imports.py checks), and this file imports nothing, so
`import artsg_nb.cpu_engine` stays cheap for code that only needs the module path. It does not
do CUDA, tensor/pipeline parallelism, quantisation, paged attention, chunked prefill,
speculative decoding, grammars and penalties, chat streaming, /v1/completions, weight updates of
the base model, or SGLang's silent reload of an adapter name that was unloaded (a request naming
it gets 400, like a name never loaded).
"""
