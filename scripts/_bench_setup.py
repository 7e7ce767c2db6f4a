"""What the measuring scripts here share: their common arguments, and the target and questions they load."""

from __future__ import annotations

import torch

from specdec.bench.questions import load_questions, select_questions
from specdec.models import load_model
from specdec.prompting import eos_ids


def add_arguments(ap) -> None:
    ap.add_argument("--model", default="default")
    ap.add_argument("--questions", required=True)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON file for the table's figures")


def load(args):
    """(target in eval mode, tokenizer, EOS ids, the questions chosen) for ``args``."""
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, weights="fp32")
    target, tok = loaded.model.eval(), loaded.tokenizer
    return target, tok, eos_ids(target, tok), select_questions(load_questions(args.questions), None,
                                                               args.per_category)
