"""One GRPO run as a notebook drives it: the `GRPORun` facade (session.py) and the parts it is
composed of: its config, the step written top to bottom (step.py) on the rollout source, the
adapter versions' owner, the pipelined (sample-ahead) rollouts, released-memory training, the
step row (history.py), server recovery and the health watchdog, the phase clock every timing
comes from, adapter retention and experiment trackers.

Nothing here does GRPO math, plays episodes or starts processes: it wires rl/, rollout/ and
serving/ together, one step at a time."""
