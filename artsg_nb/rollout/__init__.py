"""Rollouts: G episodes per prompt played against an inference server (groups.py), as trajectories
(trajectory.py, the one definition of a valid one) whose chat tokens stay exact (chat_tokens.py),
what the model wrote as a table (samples.py), and evaluation of the served adapter (evaluate.py).

Token ids and logprobs come from the server, never from re-tokenising text; training is elsewhere."""
