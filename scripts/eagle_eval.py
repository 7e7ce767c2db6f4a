"""Held-out top-1 accuracy of EAGLE heads on one data directory's held-out split (the last 5% of
distinct prompts, as `specdec train-eagle` holds out): compares heads trained on different data.

    python scripts/eagle_eval.py ~/eagle3/data specdec/data/eagle_head ~/eagle3/head
"""
import sys

import torch

from specdec.drafters.eagle import load_head
from specdec.models import load_model
from specdec.training import TrainConfig, evaluate, load_data, split_held_out

torch.set_num_threads(2)
target = load_model("default").model.eval()
config = TrainConfig()
_, held = split_held_out(load_data(sys.argv[1]), config.held_out)
print(f"{len(held)} held-out conversations, {sum(len(c.ids) - c.prompt_len for c in held)} answer tokens")
for path in sys.argv[2:]:
    with torch.no_grad():
        print(f"{path}: top-1 {evaluate(load_head(path, target), held, config):.1%}", flush=True)
