"""Training what drafts: EAGLE's data (eagle_data) and its head's objective and loop (eagle).
The command is ``specdec train-eagle`` (specdec.cli.train_eagle)."""

from specdec.training.eagle import (TrainConfig, TrainResult, batch_indices, evaluate, lr_at, split_held_out,
                                    train_head)
from specdec.training.eagle_data import (PROMPTS_FILE, Conversation, DataConfig, encode_prompts, generate_data,
                                         load_data, read_answers, read_prompts, restore_answers, save_answers)

__all__ = ["PROMPTS_FILE", "Conversation", "DataConfig", "TrainConfig", "TrainResult", "batch_indices",
           "encode_prompts", "evaluate", "generate_data", "load_data", "lr_at", "read_answers", "read_prompts",
           "restore_answers", "save_answers", "split_held_out", "train_head"]
