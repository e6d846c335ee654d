"""Reading what the model wrote (issue 50 item 4): run.samples() shows completions whole (pandas
cut them at ~45 characters), run.show_samples(k) shows k samples as cards, each with its reward
parts and finish reason: HTML in a notebook, plain text elsewhere."""
import json

import pandas as pd

from artsg_nb.run.session import GRPORun, RunConfig
from artsg_nb.view.plots.sample_cards import FullTextFrame, reward_parts, sample_cards

LONG = "Let me think. " * 12 + "The answer is 42."  # 185 characters


def _record(member, reward, completion=LONG, **extra):
    return {"step": 3, "group": 0, "seed": 7, "member": member, "prompt": "What is 40+2?",
            "completion": completion, "reward": reward, "finish_reason": "stop" if reward else "length",
            "prompt_tokens": 9, "completion_tokens": 40, "turns": 1, "truncated": False, "error": None,
            "adapter": "policy-step-2", "messages": [{"role": "user", "content": "What is 40+2?"},
                                                    {"role": "assistant", "content": completion}], **extra}


def _run_with_rollouts(tmp_path, records) -> GRPORun:
    folder = tmp_path / "run" / "rollouts"
    folder.mkdir(parents=True)
    (folder / "step-3.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return GRPORun(RunConfig(run_dir=str(tmp_path / "run")))  # not started: samples read run_dir only


def test_samples_show_each_completion_whole(tmp_path):
    run = _run_with_rollouts(tmp_path, [_record(0, 1.0), _record(1, 0.0, "short")])
    df = run.samples()
    assert isinstance(df, pd.DataFrame) and df["completion"].iloc[0] == LONG
    assert LONG in repr(df) and LONG in df._repr_html_(), "the display cut the completion"
    assert "2 messages" in repr(df) and isinstance(df["messages"].iloc[0], list)  # the data stays whole
    assert isinstance(run.samples(k=1), FullTextFrame) and len(run.samples(k=1)) == 1


def test_show_samples_prints_full_cards_best_first_outside_a_notebook(tmp_path, capsys):
    parts = {"think_format_reward": 0.0, "exact": 1.0}
    run = _run_with_rollouts(tmp_path, [_record(0, 0.0, "wrong"), _record(1, 1.0, reward_parts=parts),
                                        _record(2, None, "", error="RewardError: boom")])
    run.show_samples(k=2)
    out = capsys.readouterr().out
    assert out.startswith("step 3: 2 of 3 samples, best reward first")
    assert out.index("member 1") < out.index("member 0") and "member 2" not in out
    assert LONG in out and "reward 1.000 (think_format_reward 0.000, exact 1.000) | finish stop | 40 tokens" in out
    run.show_samples(k=3, worst=True)
    worst = capsys.readouterr().out
    assert worst.index("member 0") < worst.index("member 1") < worst.index("member 2")  # no reward: last
    assert "reward none" in worst and "error: RewardError: boom" in worst


def test_cards_are_html_in_a_notebook_and_escape_the_text():
    df = pd.DataFrame([_record(0, 0.5, "<b>bold</b> & " + LONG, **{"rewards/exact": 0.5})])
    cards = sample_cards(df, k=1)
    page = cards._repr_html_()
    assert "&lt;b&gt;bold&lt;/b&gt; &amp;" in page and "exact 0.500" in page and "pre-wrap" in page
    assert reward_parts({"rewards/a": 1.0, "reward": 2.0}) == {"a": 1.0}
