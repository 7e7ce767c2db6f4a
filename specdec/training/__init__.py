"""Training what drafts: EAGLE's data (eagle_data), its head's objective and loop (eagle), and EAGLE-3's
training-time test (eagle3). The command is ``specdec train-eagle`` (specdec.cli.train_eagle)."""

from specdec.training.eagle import (TrainConfig, TrainResult, batch_indices, evaluate, lr_at, split_held_out,
                                    train_head)
from specdec.training.eagle_data import (PROMPTS_FILE, Conversation, DataConfig, encode_prompts, generate_data,
                                         load_data, read_answers, read_prompts, restore_answers, save_answers)
from specdec.training.eagle3 import Train3Config, evaluate3, train_head3, ttt_losses

__all__ = ["PROMPTS_FILE", "Conversation", "DataConfig", "TrainConfig", "TrainResult", "batch_indices",
           "encode_prompts", "evaluate", "generate_data", "load_data", "lr_at", "read_answers", "read_prompts",
           "restore_answers", "save_answers", "split_held_out", "train_head", "Train3Config", "evaluate3", "train_head3",
           "ttt_losses"]
