"""The CPU engine refuses a prompt too long for its context by its length, before tokenising it.

A real CPU engine (tiny model) gets six 1e6-character prompts (/generate text, and chat
messages): each is refused with HTTP 400 saying it is longer than the context, and the server's
resident memory grows by less than 40 MB over all six (before: each was tokenised first and left
~125 MB resident). A prompt that fits is still served.
"""
from __future__ import annotations

import httpx
import psutil

from artsg_nb.serving.server import ServerConfig, start_server


def test_a_huge_prompt_is_refused_before_it_is_tokenised(tmp_path, tiny_model_dir):
    server = start_server(ServerConfig(engine="cpu", model_path=str(tiny_model_dir), run_dir=str(tmp_path)))
    try:
        headers = {"Authorization": f"Bearer {server.api_key}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=120) as http:
            def generate(text):
                return http.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}})

            assert generate("Hello").status_code == 200
            rss = psutil.Process(server.pid).memory_info().rss
            huge = "word " * 200_000  # 1e6 characters
            for _ in range(4):
                r = generate(huge)
                assert r.status_code == 400 and "longer than the model's context length" in r.text, r.text[:300]
            for _ in range(2):
                r = http.post("/v1/chat/completions", json={"model": "default", "max_tokens": 1,
                                                            "messages": [{"role": "user", "content": huge}]})
                assert r.status_code == 400 and "longer than the model's context length" in r.text, r.text[:300]
            grown_mb = (psutil.Process(server.pid).memory_info().rss - rss) / 2**20
            assert grown_mb < 40, f"the server grew by {grown_mb:.0f} MB over six refused prompts"
            assert generate("Hello").status_code == 200
    finally:
        server.stop()
