"""One GRPO run as a notebook drives it: the `GRPORun` facade (session.py) and the parts it is
composed of: its config, the step history, server recovery and the health watchdog, the pipelined
(sample-ahead) step, released-memory training, adapter retention and experiment trackers.

Nothing here does GRPO math, plays episodes or starts processes: it wires rl/, rollout/ and
serving/ together, one step at a time."""
