"""Tasks: the public `Task` type and its registry with the example tasks (registry.py), the
addition questions for chat models (chat.py: `addition_chat`, registered here), tasks built from a
dataset (dataset.py) and the environment protocol episodes are played through (episode.py).

A task gives prompts, environments and rewards; it knows nothing of servers or training."""
from .chat import ADDITION_CHAT
from .registry import register_task

register_task(ADDITION_CHAT, replace_existing=True)  # a re-import of this package re-registers it
