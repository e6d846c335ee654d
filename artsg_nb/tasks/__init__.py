"""Tasks: the public `Task` type and its registry with the example tasks (registry.py), tasks built
from a dataset (dataset.py) and the environment protocol episodes are played through (episode.py).

A task gives prompts, environments and rewards; it knows nothing of servers or training."""
