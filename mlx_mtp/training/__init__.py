"""Training an MTP head for a model that has none (``mlx-mtp train-head``).

Apart from the runtime, as mlx-lm keeps its trainer in ``tuner/``:

- ``prompts``: the self-distillation prompt generator and the held-out prompts;
- ``data``: ``--data`` files, windows, batched self-distillation;
- ``corpus``: ``--text`` files and folders, the ready corpus (``--corpus``);
- ``shards``: the frozen trunk's hidden states, memory-mapped on disk;
- ``head``: building, chaining and saving a DeepSeek-style head;
- ``trainer``: the training loop, chained drafts included;
- ``evaluate``: held-out acceptance, costs, the recommended draft-max;
- ``run``: the whole command.
"""

from .head import HEAD_FILE, init_head, save_head
from .run import DataConfig, Hooks, RunConfig, Stop, train_head
from .trainer import TrainConfig, train

__all__ = [
    "HEAD_FILE",
    "DataConfig",
    "Hooks",
    "RunConfig",
    "Stop",
    "TrainConfig",
    "init_head",
    "save_head",
    "train",
    "train_head",
]
