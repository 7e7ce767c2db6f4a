"""Where an EAGLE step's time goes: draft / verify / other ms per step and tokens/s for tree configs
(nodes,depth,top_k), 6 Spec-Bench questions, 128 new tokens, packaged head; and a plain step's time.

    python scripts/eagle_breakdown.py QUESTIONS_JSONL 8,4,4 5,3,3 4,4,1
"""
import sys
import time, torch, statistics
from specdec import SpecDecoder
from specdec.controller import DraftLengthConfig
from specdec.decoder import SpecDecoderConfig
from specdec.drafters.eagle import EagleConfig, EagleDrafter
from specdec.models import load_model
from specdec.bench.questions import load_questions, select_questions
from specdec.prompting import chat_ids as chat_input_ids, eos_ids
torch.set_num_threads(2)
ALWAYS = SpecDecoderConfig(draft_length=DraftLengthConfig(cost_aware=False))  # the tree every step: no gate
m = load_model("default"); model, tok = m.model.eval(), m.tokenizer
eos = eos_ids(model, tok, required=True)
qs = select_questions(load_questions(sys.argv[1]), limit_per_category=1)[:6]
for cfg in [tuple(int(x) for x in a.split(",")) for a in sys.argv[2:]]:
    d = EagleDrafter.default(model, EagleConfig(*cfg))
    dr=vr=tot=0; steps=toks=0
    for q in qs:
        ids = chat_input_ids(tok, [{"role": "user", "content": q.turns[0]}])
        t=time.perf_counter(); out = SpecDecoder(model, d, ALWAYS).generate(ids, max_new_tokens=128, eos_token_id=eos); tot+=time.perf_counter()-t
        dr += sum(s.draft_time for s in out.steps); vr += sum(s.verify_time for s in out.steps)
        steps += len(out.steps); toks += out.new_tokens
    print(cfg, f"tau {toks/steps:.2f} per step ms: draft {dr/steps*1e3:.1f} verify {vr/steps*1e3:.1f} other {(tot-dr-vr)/steps*1e3:.1f}  tok/s {toks/tot:.1f}", flush=True)
# plain 1-token step reference
out = SpecDecoder(model, None).generate(chat_input_ids(tok, [{"role": "user", "content": qs[0].turns[0]}]), max_new_tokens=128, eos_token_id=eos)
print("plain", f"verify {statistics.median(s.verify_time for s in out.steps[1:])*1e3:.1f} ms/step")
