"""The README as a guide (issue 50 item 1): its sections in a user's order, no dated diary (that is
benchmarks/results/HISTORY.md), every results ratio saying which TRL mode it is against, and its
own-task example running as printed."""
import re
from pathlib import Path

import artsg_nb as ag

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_sections_come_in_a_users_order():
    titles = re.findall(r"^## (.+)$", README, re.M)
    assert titles == ["1. Two commands", "2. Open the notebooks", "3. Your own task", "4. Headless", "5. Options",
                      "6. Results", "7. More"]
    assert "make lab" in README.split("## 3.")[0]


def test_no_diary_in_the_readme():
    diary = re.findall(r"(?i)\b(?:[a-z-]+teenth|twenty-\w+|third|later) (?:session|lease)\b|build item \d", README)
    assert not diary, diary
    assert (ROOT / "benchmarks" / "results" / "HISTORY.md").exists()


def test_results_say_which_trl_they_compare_with():
    results = README.split("## 6. Results")[1].split("## 7.")[0]
    assert "use_vllm=False" in results and "TRL (`generate`)" in results
    assert re.search(r"\d{4}-\d{2}-\d{2}, one NVIDIA H100 80GB HBM3, commit `[0-9a-f]{7}`", results)


def test_docs_the_readme_links_exist():
    for path in re.findall(r"`((?:docs|benchmarks|tools)/[\w./-]+\.md)`", README):
        assert (ROOT / path).exists(), path


def test_the_own_task_example_plays_an_episode():
    block = re.search(r"```python\n(import random\nimport artsg_nb as ag\n.*?)```", README, re.S).group(1)
    assert len(block.strip().splitlines()) <= 22
    scope = {}
    exec(block, scope)  # noqa: S102 — the README's own code
    task = scope["task"]
    assert isinstance(task, ag.Task) and task.max_turns == 4
    env = task.make_env(3)
    secret = env.secret
    assert env.reset()[0]["role"] == "user"
    low = env.step("1" if secret > 1 else "2")
    assert not low.done and low.reward is None and low.messages[0]["content"] in ("higher", "lower")
    won = env.step(f"It is {secret}.")
    assert won.done and won.reward == 1.0
