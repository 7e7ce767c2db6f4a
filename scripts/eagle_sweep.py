"""EAGLE tree-size sweep: HF generate vs EagleDrafter tree configs on Spec-Bench, 1 question per category,
128 new tokens, methods rotating per question, one process; prints speedups, tau, identical.
Trees are (total nodes, depth, top-k), drafted every step (the controller's gate off, to compare
trees); "none" = SpecDecoder without a drafter (plain decoding).

    python scripts/eagle_sweep.py HEAD_DIR QUESTIONS_JSONL [nodes,depth,top_k ...] [--gated]
"""
import statistics, sys, time, json
import torch
from specdec import SpecDecoder
from specdec.controller import DraftLengthConfig
from specdec.decoder import SpecDecoderConfig
from specdec.drafters.eagle import EagleConfig, make_eagle
from specdec.models import load_model
from specdec.bench.questions import load_questions, select_questions
from specdec.prompting import chat_ids as chat_input_ids, eos_ids

torch.set_num_threads(2)
ALWAYS = SpecDecoderConfig(draft_length=DraftLengthConfig(cost_aware=False))  # the tree every step: no gate
head, questions = sys.argv[1], sys.argv[2]
m = load_model("default"); model, tok = m.model.eval(), m.tokenizer
eos = eos_ids(model, tok, required=True)
qs = select_questions(load_questions(questions), limit_per_category=1)
configs = [tuple(int(x) for x in a.split(",")) for a in sys.argv[3:] if a != "--gated"] or [(8, 4, 4), (12, 5, 4), (16, 6, 4)]
methods = {"hf": None, "none": "none", **{f"eagle{c}": EagleConfig(*c) for c in configs}}
if "--gated" in sys.argv:  # also the default tree with the controller's gate on (what `--drafter eagle` runs)
    methods["eagle-gated"] = "gated"
def run(name, ids, n):
    if methods[name] == "none":
        out = SpecDecoder(model, None).generate(ids, max_new_tokens=n, eos_token_id=eos)
        return out.sequences, out.mean_accepted_tokens
    if methods[name] == "gated":
        out = SpecDecoder(model, make_eagle(model, head)).generate(ids, max_new_tokens=n, eos_token_id=eos)
        return out.sequences, out.mean_accepted_tokens
    if methods[name] is None:
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos[0]), None
    out = SpecDecoder(model, make_eagle(model, head, methods[name]), ALWAYS).generate(ids, max_new_tokens=n, eos_token_id=eos)
    return out.sequences, out.mean_accepted_tokens
for name in methods: run(name, tok("Hello", return_tensors="pt")["input_ids"], 4)
rows = {k: [] for k in methods}
names = list(methods)
for i, q in enumerate(qs):
    ids = chat_input_ids(tok, [{"role": "user", "content": q.turns[0]}])
    order = names[i % len(names):] + names[: i % len(names)]
    res = {}
    for k in order:
        t = time.perf_counter(); seq, tau = run(k, ids, 128); dt = time.perf_counter() - t
        res[k] = (seq, tau, dt)
    for k in names:
        seq, tau, dt = res[k]
        rows[k].append(dict(tps=(seq.shape[1]-ids.shape[1])/dt, tau=tau, same=bool(torch.equal(seq, res["hf"][0]))))
    print(q.category, {k: round(res["hf"][2]/res[k][2], 2) for k in names if k != "hf"}, {k: round(res[k][1], 2) for k in names if k != "hf"}, flush=True)
base = statistics.mean(r["tps"] for r in rows["hf"])
for k in names:
    print(k, "speedup %.2f" % (statistics.mean(r["tps"] for r in rows[k]) / base),
          "tau %s" % (None if k == "hf" else round(statistics.mean(r["tau"] for r in rows[k]), 2)),
          "identical", all(r["same"] for r in rows[k]))
