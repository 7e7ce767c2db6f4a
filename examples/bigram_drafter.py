"""A drafter plugin in one file: guess that each token is followed by what followed it last time.
The contract it implements is explained in docs/drafters.md. Run it: python examples/bigram_drafter.py"""
import torch

from specdec.drafters.base import Capabilities, Commit, Drafter, Prompt
from specdec.tree import DraftTree


class BigramDrafter(Drafter):
    # a dict walk costs microseconds and changes nothing (free_drafts); one table per row (batches);
    # its chains are deterministic, so valid under sampling (probs None is a one-hot q)
    capabilities = Capabilities(free_drafts=True, batches=True, samples=True)

    def begin(self, prompt: Prompt) -> None:
        self.tables: list[dict[int, int]] = [{} for _ in prompt.lengths]  # per row: token -> the next one
        self.last: list[list[int]] = [[] for _ in prompt.lengths]  # per row: its last token
        for b, n in enumerate(prompt.lengths.tolist()):
            self._learn(b, prompt.input_ids[b, :n].tolist())

    def _learn(self, b: int, tokens: list[int]) -> None:
        text = self.last[b] + tokens
        self.tables[b].update(zip(text, text[1:]))  # later pairs overwrite earlier ones
        self.last[b] = text[-1:]

    def propose(self, budget: int) -> DraftTree:
        drafts = []
        for table, last in zip(self.tables, self.last):
            chain = []
            while len(chain) < budget and (chain or last)[-1] in table:
                chain.append(table[(chain or last)[-1]])
            drafts.append(chain)
        tokens = torch.zeros(len(drafts), max(map(len, drafts)), dtype=torch.long)  # [B, N] right-padded
        for b, chain in enumerate(drafts):
            tokens[b, : len(chain)] = torch.tensor(chain, dtype=torch.long)
        return DraftTree.chain(tokens, torch.tensor([len(c) for c in drafts], dtype=torch.long))

    def accept(self, commit: Commit) -> None:
        for b in range(len(self.tables)):
            self._learn(b, commit.new_tokens(b))

    def select(self, rows: list[int]) -> None:
        self.tables, self.last = [self.tables[b] for b in rows], [self.last[b] for b in rows]


def make(target) -> BigramDrafter:
    """The factory a registry name maps to (an entry point: bigram = "bigram_drafter:make")."""
    return BigramDrafter()


if __name__ == "__main__":
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec import SpecDecoder
    from specdec.drafters import LookupHybridDrafter, PromptLookupDrafter, Sources
    from specdec.registry import make_drafter, register_drafter

    register_drafter("bigram", make)  # `--drafter bigram`, for the commands of a process that ran this
    torch.manual_seed(0)  # a tiny random model, float64 so greedy has no ties; no download
    target = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)).double()
    ids = torch.randint(0, 128, (1, 12)).repeat(1, 2)  # a prompt that repeats itself
    want = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    for name, drafter in [("bigram", make_drafter("bigram", target)), ("hybrid", LookupHybridDrafter(BigramDrafter())),
                          ("auto", Sources({"lookup": PromptLookupDrafter(), "bigram": BigramDrafter()}))]:
        out = SpecDecoder(target, drafter).generate(ids, max_new_tokens=24)
        print(f"{name}: same as target.generate {torch.equal(out.sequences, want)}, tau {out.mean_accepted_tokens:.2f}")
    batch = SpecDecoder(target, BigramDrafter()).generate([ids[0, :7], ids[0]], max_new_tokens=16)
    sampled = SpecDecoder(target, BigramDrafter()).generate(ids, max_new_tokens=16, do_sample=True, seed=0)
    print(f"a batch of 2: {batch.num_new} new tokens; sampled: {sampled.generated(0).tolist()}")
