"""ART's managed client on a real server: do the server's token ids reach the trajectory?

usage: python3 tools/gpu/art_ids.py [--engine sglang|cpu] [--model-path DIR] [--requests 16]

For issue 27: `SGLangBackend` makes `model.openai_client()` ask SGLang for its token ids
(`return_meta_info`, `return_prompt_token_ids`, engines/sglang.py CHAT_TOKEN_IDS); `art.convert`
then uses them as sent instead of looking tokens up from their strings. The CPU engine's test
(tests/test_art.py) checks this against the CPU engine's rendition of SGLang's reply; this checks
the real server: an `art.TrainableModel` registered with `SGLangBackend` (RunConfig defaults), then
`--requests` chat completions with logprobs through `model.openai_client()`, each choice turned into
our trajectory. Prints how many choices carried `meta_info.output_token_logprobs` and
`prompt_token_ids`, how many trajectories used exactly those ids, and `PASS art-ids` when all did.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile


async def check(engine: str, model_path: str | None, requests: int) -> bool:
    import art

    from artsg_nb.art import SGLangBackend
    from artsg_nb.art.convert import to_trajectory
    from artsg_nb.models.tiny import default_model_dir
    from artsg_nb.run.config import RunConfig
    from artsg_nb.tasks.registry import get_task

    task = get_task("addition")
    backend = SGLangBackend(path=tempfile.mkdtemp(prefix="art-ids-"), config=RunConfig(engine=engine, verbose=False))
    model = art.TrainableModel(name="ids", project="art-ids", base_model=model_path or str(default_model_dir()))
    await model.register(backend)
    try:
        tokenizer, with_ids, exact = backend.run(model).trainer.tokenizer, 0, 0
        for seed in range(requests):
            messages = task.make_env(seed).reset()
            completion = await model.openai_client().chat.completions.create(
                model=model.get_inference_name(), messages=messages, max_tokens=task.max_new_tokens, logprobs=True)
            choice = completion.choices[0]
            extra = choice.model_extra or {}
            triples = (extra.get("meta_info") or {}).get("output_token_logprobs")
            prompt = extra.get("prompt_token_ids")
            if triples and prompt:
                with_ids += 1
                ours = to_trajectory(art.Trajectory(messages_and_choices=[*messages, choice]), tokenizer, None)
                exact += ours.token_ids == prompt + [int(t[1]) for t in triples]
        print(f"{engine}: {with_ids} of {requests} choices carried the server's ids; {exact} trajectories used "
              f"exactly those ids", flush=True)
        return with_ids == exact == requests
    finally:
        await backend.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="sglang")
    p.add_argument("--model-path", default=None)
    p.add_argument("--requests", type=int, default=16)
    a = p.parse_args(argv)
    ok = asyncio.run(check(a.engine, a.model_path, a.requests))
    print(f"{'PASS' if ok else 'FAIL'} art-ids ({a.engine})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
