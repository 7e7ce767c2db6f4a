"""A live batch advanced one step at a time: the core of ``SpecDecoder.generate`` and of the server.

    session = DecodeSession(decoder, eos={2})
    ids = session.add([prompt_a, prompt_b], max_new=[64, 64], judge=Acceptance())  # prefill, first tokens
    while session.rows:
        events = session.step()          # draft -> verify -> accept -> commit, every live row
        session.remove([ids[0]])         # a cancelled sequence leaves at the step boundary

``add`` prefills new prompts in their own store, then joins their rows to the running batch (copied
into the store's room for batch rows, ``BMCCache.append``); the drafters restart from every live row's
committed text (``begin`` + ``accept`` of the pending tokens: the state a text-matching or
self-speculating drafter would hold anyway) at the next step that drafts, not at the join. A drafter
that reads the target's hidden states (EAGLE) cannot restart so: ``joins`` is False for it and a
caller adds only to an empty session. Sequences stop on their own EOS or max_new and leave
(compaction: later rows move down in place); ``remove`` drops rows the same way. Each row is judged
by ``judge``'s rule for it: one rule for a ``generate`` run (``specdec.judging.Acceptance``), or one per
row for a server (``specdec.serve.acceptance``).

Invariant between steps: the target's BMC store holds every committed token of each live sequence
but the last one, the *pending* token, which opens the next verify block (row 0), followed by the
draft tree's nodes. The prefill runs the prompts on the causal fast path, as HF does (prompts of one
length together, in forwards of at most PREFILL_TOKENS tokens), and gives the first token; with a
prefix cache (``specdec.kv.prefix``) each prompt takes its longest cached prefix and prefills the rest
in aligned blocks, hit or miss, so a reused prefix changes no bit (docs/decisions/021-prefix-cache.md).

The session is the loop; its parts live beside it: ``specdec.steps`` (what a step yields, the table of
live sequences, what the controller learns) and ``specdec.judging`` (the acceptance rule and the pure
helpers around a verify block: the grammar's cut, processed logits, the commit).

Dimensions: B live rows, P prompt columns, N draft nodes, A accepted drafts, D hidden size, V vocab.
"""

from __future__ import annotations

import time

import torch

from specdec.controller import period
from specdec.drafters.base import Commit, Prompt
from specdec.drafters.chooser import draft_step
from specdec.forward import forward_block, prefill, prefill_aligned
from specdec.introspect import attention_shape
from specdec.judging import Judge, constrain, is_chain, judge_processed, make_commit, read_groups, unread_rows
from specdec.kv.bmc import BMCCache
from specdec.kv.static import StaticCache
from specdec.processing import Processing, RowProcessor
from specdec.quant.numerics import Numerics, numerics_of
from specdec.steps import Batch, SequenceResult, StepEvent, StepOutcome, StepStats, learn_step
from specdec.tree import DraftTree, ancestor_mask, node_depths
from specdec.verifiers.tree import Verification

PREFILL_TOKENS = 4096  # prompt tokens per prefill forward (prompts of one length go together up to this)


class DecodeSession:
    """The live batch of one ``SpecDecoder`` (its target, drafter, controller and config); run it
    inside ``decoder.running()``. Sequence ids count up from 0 over the session's life."""

    def __init__(self, decoder, eos: set[int], record_steps: bool = True) -> None:
        self.decoder = decoder
        self.record_steps = record_steps  # keep every StepStats in ``steps`` (a server's would grow forever)
        self.batch = Batch(eos)
        self.cache: BMCCache | None = None  # None while no row is live
        self.pending: torch.Tensor | None = None  # [B, 1] each live row's pending token
        self.judge: Judge | None = None  # the acceptance rule of the live rows
        self.steps: list[StepStats] = []  # every step so far, prefills included
        self._next_id = 0
        # rows joined since the drafters last began: they restart at the next step that drafts (a batch
        # whose drafting is priced out pays no restart per join, and no accept or select per step)
        self._drafters_behind = False
        self._restart_seconds = 0.0  # spent restarting them in the current step's draft

    @property
    def rows(self) -> list[int]:
        """The live sequences' ids, in batch-row order."""
        return self.batch.rows

    @property
    def joins(self) -> bool:
        """Whether prompts can join while rows are live (the drafters restart from text alone)."""
        return not self.decoder.reads_hidden

    # -- the three verbs

    def add(self, prompts: list[torch.Tensor], max_new: list[int], judge,
            processing: list[Processing | None] | None = None) -> tuple[list[int], list[StepEvent]]:
        """Prefill ``prompts`` (1-D int64 each; ``max_new`` tokens each at most, already within the
        context window) and join them to the batch; ``judge`` holds their acceptance rule, ``processing``
        each one's penalties, biases, grammar and logprobs (None: none). Returns their sequence ids and
        the events of their first tokens."""
        B = len(prompts)
        ids = list(range(self._next_id, self._next_id + B))
        self._next_id += B
        processing = processing or [None] * B
        assert len(processing) == B, f"{B} prompts, {len(processing)} processing options"
        for s, p, m, opts in zip(ids, prompts, max_new, processing):
            ids_ = p.tolist()
            proc = RowProcessor(ids_, opts, self.decoder.vocab_size) if opts is not None else None
            self.batch.add(s, ids_, m, proc)
        if not self.rows:
            return ids, self._start(ids, prompts, judge)
        if not self.joins:
            raise ValueError(f"drafter {type(self.decoder.drafter).__name__} reads the target's hidden states: "
                             "new sequences cannot join a running batch (add them when it is empty)")
        return ids, self._join(ids, prompts, judge)

    def step(self) -> list[StepEvent]:
        """One step for every live row: 1. draft, 2.-4. verify and commit, 5. learn, finished rows leave."""
        d, batch, judge = self.decoder, self.batch, self.judge
        controller = d.controller
        t0 = time.perf_counter()
        # 1. draft: never more than the tokens some sequence still wants after its bonus token; shadow
        # drafts are scored against the committed text: greedy only (a sampled token that differs
        # from a draft does not mean the draft would have been rejected)
        shadow = d.config.shadow_drafts and judge.greedy
        self._restart_seconds = 0.0
        key, tree, shadows = draft_step(d.chooser, controller, len(batch.rows), batch.wanted(), shadow,
                                        ready=self._catch_up_drafters)
        tree, masks = constrain(tree, batch.live_processors())  # nodes a grammar forbids are cut here
        t1 = time.perf_counter()
        t0 += self._restart_seconds  # a join's restart is not the price of this step's draft
        # 2.-4. one target forward over [pending, nodes] per row, the acceptance rule, commit the kept rows
        allocations = self.cache.num_allocations
        ver, hidden, split, logprobs = self._verify(tree, masks)
        commit = make_commit(tree, ver, hidden)
        t2 = time.perf_counter()
        stats = StepStats(tree.num_nodes.tolist(), ver.num_accepted.tolist(), t1 - t0, t2 - t1,
                          list(batch.rows), split, key if tree.width else None)
        # 5. the controller adapts; outputs grow; the drafter learns; finished rows leave
        # a drafter's catch-up (EAGLE's head fed a whole prompt) is not the price of this draft's size;
        # the part after a pause is a price of drafting again (the step's gain)
        catch_up, resume = (d.chooser.catch_up_seconds(), d.chooser.resume_seconds()) \
            if d.chooser is not None else (0.0, 0.0)
        texts = [commit.new_tokens(b) for b in range(len(batch.rows))] if shadows else []
        learn_step(controller, StepOutcome(key, tree, ver.accepted.tolist(), stats.verify_time,
                                           max(0.0, stats.draft_time - catch_up), shadows, texts,
                                           grew=self.cache.num_allocations != allocations, resume=resume,
                                           catch_up=catch_up))
        events = self._finish(commit, ver.next_token, stats, logprobs)
        controller.set_batch(len(self.rows))
        return events

    def remove(self, seqs) -> None:
        """Drop the live rows of sequences ``seqs`` (cancelled) between steps; others are ignored."""
        gone = set(seqs)
        self._keep([r for r, s in enumerate(self.rows) if s not in gone])

    def result(self, s: int) -> SequenceResult:
        """What sequence ``s`` (an id ``add`` returned, live or finished and not forgotten) generated so far."""
        b = self.batch
        return SequenceResult(list(b.new[s]), b.steps[s], b.accepted[s])

    def forget(self, s: int) -> None:
        """Drop what is kept of finished sequence s (a server's sequences never end)."""
        assert s not in self.rows, f"sequence {s} is live: remove it first"
        self.batch.forget(s)

    # -- joining

    def _new_store(self, seqs: list[int], longest: int, first: bool = False) -> BMCCache:
        """The store for sequences ``seqs`` (``longest``: their longest prompt): BMC, or with
        ``config.static`` one sized for their prompts and answers (``kv.static``), the decoder's spare
        for the ``first`` of a session (its captured steps with it)."""
        d, B = self.decoder, len(seqs)
        if d.config.static is not None:
            rows = max(len(self.batch.prompt[s]) + self.batch.max_new[s] for s in seqs)
            if first:
                return d.spare_store.take(d.target, B, rows, d.config.static)
            return StaticCache.for_model(d.target, B, rows, d.config.static)
        cache = BMCCache.for_model(d.target, B, d.config.bmc)
        if d.config.adaptive_period:
            model = _period_model(d.target)
            cache.period_policy = lambda held: model.period(held + self.batch.wanted(), held)
            cache.set_period(cache.period_policy(longest) if self.cache is None else self.cache.period)
        return cache

    def _start(self, ids: list[int], prompts: list[torch.Tensor], judge) -> list[StepEvent]:
        """The first prompts of an empty session: the drafters begin on them (with the prompt's hidden
        states if they read them), as one ``generate`` call."""
        self.judge = judge
        self.batch.rows = list(ids)
        self._drafters_behind = False  # they begin on these prompts
        self.decoder.controller.new_run(len(ids))
        self.cache = self._new_store(ids, max(len(p) for p in prompts), first=True)
        t0 = time.perf_counter()
        ver, commit, logprobs = self._prefill(self.cache, ids, prompts, judge, begin=True)
        stats = StepStats([0] * len(ids), [0] * len(ids), 0.0, time.perf_counter() - t0, list(ids))
        return self._finish(commit, ver.next_token, stats, logprobs)

    def _join(self, ids: list[int], prompts: list[torch.Tensor], judge) -> list[StepEvent]:
        """Prompts joining live rows: prefilled in their own store, appended at the step boundary; the
        drafters restart from every live row's committed text."""
        d, batch = self.decoder, self.batch
        cache = self._new_store(ids, max(len(p) for p in prompts))
        t0 = time.perf_counter()
        ver, commit, logprobs = self._prefill(cache, ids, prompts, judge, begin=False)
        stats = StepStats([0] * len(ids), [0] * len(ids), 0.0, time.perf_counter() - t0, list(ids))
        self._record(stats)
        events, keep = batch.extend(ids, commit, stats, logprobs)
        if keep:  # the ones that did not finish with their first token join
            if len(keep) < len(ids):
                cache.select(keep)
                judge.select(keep)
            self.cache.append(cache)
            self.judge = self.judge.joined(judge)
            batch.rows += [ids[k] for k in keep]
            self.pending = torch.cat([self.pending, ver.next_token[keep, None].to(self.pending.device)])
            self._drafters_behind = self.decoder.chooser is not None
            d.controller.set_batch(len(batch.rows))
        return events

    def _catch_up_drafters(self) -> None:
        """Before a step drafts: restart the drafters if rows joined since they began."""
        if self._drafters_behind:
            t0 = time.perf_counter()
            self._restart_drafters()
            self._drafters_behind = False
            self._restart_seconds = time.perf_counter() - t0

    def _restart_drafters(self) -> None:
        """begin() on every live row's committed text but the pending token (what the store holds),
        then accept() of the pending tokens: the state the drafters reach in a run of their own."""
        chooser = self.decoder.chooser
        texts = [self.batch.text(s) for s in self.rows]
        B, P = len(texts), max(len(t) for t in texts) - 1
        ids = torch.zeros(B, P, dtype=torch.long)  # right-padded, as Prompt says
        for b, t in enumerate(texts):
            ids[b, : len(t) - 1] = torch.tensor(t[:-1], dtype=torch.long)
        lengths = torch.tensor([len(t) - 1 for t in texts], dtype=torch.long)
        chooser.begin(Prompt(ids, lengths, None, self.cache, self.judge.sampling, self.judge.generator,
                             self.batch.live_processors()))
        pending = self.pending.cpu()
        ones = torch.ones(B, dtype=torch.long)
        chooser.accept(Commit(pending, ones, torch.zeros(B, dtype=torch.long)))

    # -- stages

    def _prefill(self, cache: BMCCache, seqs: list[int], prompts: list[torch.Tensor], judge,
                 begin: bool) -> tuple[Verification, Commit, list | None]:
        """Prompts of one length together (no padding: HF's unpadded prefill), each length alone,
        through ``forward.prefill`` into their rows, or with the decoder's prefix cache each prompt alone
        (``_prefill_reusing``); the first token of each (sequences ``seqs``), with its logprobs where
        asked. ``begin``: the drafters begin on these prompts."""
        d = self.decoder
        want_hidden = d.reads_hidden
        B, P = len(prompts), max(len(p) for p in prompts)
        groups: dict[int, list[int]] = {}
        for b, p in enumerate(prompts):
            groups.setdefault(len(p), []).append(b)
        logits: list[torch.Tensor | None] = [None] * B
        hidden: list[torch.Tensor | None] = [None] * B
        # at most PREFILL_TOKENS per forward: its DynamicCache is a transient second copy of those rows'
        # K/V (why: docs/decisions/011-prefill-chunks.md)
        chunks = [rows[i : i + max(1, PREFILL_TOKENS // n)] for n, rows in groups.items()
                  for i in range(0, len(rows), max(1, PREFILL_TOKENS // n))]
        if self._reuses_prefixes():  # each prompt alone, in aligned blocks over what the cache holds (the
            # blocks of this batch's earlier prompts included): docs/decisions/021-prefix-cache.md
            for b, s in enumerate(seqs):
                logits[b], self.batch.cached[s] = self._prefill_reusing(cache, b, prompts[b], P)
            chunks = []
        for rows in chunks:
            pre = prefill(d.target, torch.stack([prompts[b] for b in rows]), want_hidden, d.hidden_layers)
            for g, b in enumerate(rows):
                cache.load_prefill(b, [(k[g], v[g]) for k, v in pre.layers], capacity=P)
                logits[b] = pre.logits[g]
                hidden[b] = pre.hidden[g] if want_hidden else None
        procs = [self.batch.processors.get(s) for s in seqs]
        empty = DraftTree.empty(B)  # the first token: nothing drafted
        ver, logprobs = judge_processed(judge, procs, torch.stack(logits)[:, None], empty, constrain(empty, procs)[1])
        last = torch.stack([h[-1:] for h in hidden]) if want_hidden else None  # [B, 1, D]
        if begin and d.chooser is not None:
            ids = torch.zeros(B, P, dtype=torch.long)  # right-padded, as Prompt says
            prefix = torch.zeros(B, max(P - 1, 0), hidden[0].shape[-1], dtype=hidden[0].dtype) if want_hidden else None
            for b, p in enumerate(prompts):
                ids[b, : len(p)] = p
                if want_hidden:
                    prefix[b, : len(p) - 1] = hidden[b][:-1]
            lengths = torch.tensor([len(p) for p in prompts])
            d.chooser.begin(Prompt(ids, lengths, prefix, cache, judge.sampling, judge.generator, procs))
        return ver, make_commit(empty, ver, last), logprobs

    def _reuses_prefixes(self) -> bool:
        """Prompts go through the decoder's prefix cache, an empty budget's too (not with a drafter that
        reads the prompt's hidden states: the cache keeps K/V rows only)."""
        return self.decoder.prefix_cache is not None and not self.decoder.reads_hidden

    def _prefill_reusing(self, cache: BMCCache, b: int, prompt: torch.Tensor, capacity: int) -> tuple[torch.Tensor, int]:
        """Prompt ``prompt`` into batch row b of ``cache``: its longest cached prefix taken, the rest
        prefilled in aligned blocks (``forward.prefill_aligned``), its whole blocks kept for later.
        Returns its logits after the last token [V] and the rows reused."""
        d = self.decoder
        prefix_cache = d.prefix_cache
        tokens = prompt.tolist()
        hit = prefix_cache.lookup(tokens)
        pre = prefill_aligned(d.target, prompt, prefix_cache.block, hit.layers or None)
        prefix_cache.stats.tokens_prefilled += len(tokens) - hit.tokens
        layers = [(k[0], v[0]) for k, v in pre.layers]  # [H, P, D] each
        prefix_cache.insert(tokens, layers)
        cache.load_prefill(b, layers, capacity=capacity)
        return pre.logits[0], hit.tokens

    def cached_tokens(self, s: int) -> int:
        """Prompt tokens of sequence s taken from the prefix cache (0: none, or no cache)."""
        return self.batch.cached.get(s, 0)

    def _verify(self, tree: DraftTree, masks: list) -> tuple[Verification, torch.Tensor | None, bool, list | None]:
        """One target forward over [pending token, tree nodes] per row; keep pending + the accepted path
        (the rule of each row, over the logits each row's processor made of its own: ``masks``, the
        grammar's allowed tokens per block row). Returns the verification, the target's last hidden
        states at the kept rows [B, 1 + A, D] if the drafter reads them (row j produced new token j),
        whether attention ran SPLIT, and the kept tokens' logprobs where rows asked."""
        d, cache, pending = self.decoder, self.cache, self.pending
        want_hidden = d.reads_hidden
        B, N = tree.tokens.shape
        block_ids = torch.cat([pending, tree.tokens.to(pending.device)], dim=1)  # [B, 1 + N]
        if is_chain(tree):
            mask = depth = None  # causal block: the store's fast path (ragged chains are causal too)
        else:
            mask = ancestor_mask(tree.parents, tree.num_nodes)
            depth = torch.cat([torch.zeros(B, 1, dtype=torch.long), node_depths(tree.parents)], dim=1)
        split = self._split(1 + N)
        # the groups of tokens read: only an int8 output layer computes them alone (``fastpath``)
        vocab = read_groups(masks, d.vocab_size) if numerics_of(d.target) is Numerics.INT8 else None
        res = forward_block(d.target, cache, block_ids, mask, depth, want_hidden, split, d.hidden_layers,
                            unread=unread_rows(masks, 1 + N), vocab=vocab)
        ver, logprobs = judge_processed(self.judge, self.batch.live_processors(), res.logits, tree, masks)
        kept = ver.kept_rows()
        cache.commit(kept)
        hidden = None
        if want_hidden:
            width = max(len(k) for k in kept)
            idx = torch.tensor([k + [k[-1]] * (width - len(k)) for k in kept], device=res.hidden.device)
            hidden = res.hidden.gather(1, idx[:, :, None].expand(-1, -1, res.hidden.shape[-1]))
        return ver, hidden, split, logprobs

    def _split(self, q: int) -> bool:
        """SPLIT attention this step? auto: when PAD's padded columns would be over split_waste of them.
        Example: lengths [200, 4000], q 4: PAD 8008 columns, 4208 needed -> waste 0.47 -> SPLIT."""
        config, cache = self.decoder.config, self.cache
        if cache.batch_size == 1 or config.attention == "pad" or config.static is not None:
            return False  # a static step attends PAD (kv.static)
        if config.attention == "split":
            return True
        padded = cache.batch_size * (cache.max_length + q)
        return 1 - sum(n + q for n in cache.lengths) / padded > config.split_waste

    def _finish(self, commit: Commit, next_token: torch.Tensor, stats: StepStats,
                logprobs: list | None = None) -> list[StepEvent]:
        """Record the step, let the drafter learn, drop finished rows; the step's events."""
        self._record(stats)
        events, keep = self.batch.extend(self.rows, commit, stats, logprobs)
        chooser = self.decoder.chooser
        if chooser is not None and not self._drafters_behind:  # also after the last step: a drafter's
            chooser.accept(commit)  # state ends in step
        self.pending = next_token[:, None].to(self.cache.device)  # the target's; model.device walks the modules
        self._keep(keep)
        return events

    def _record(self, stats: StepStats) -> None:
        if self.record_steps:
            self.steps.append(stats)

    def _keep(self, keep: list[int]) -> None:
        """Compaction: keep live rows ``keep`` (ascending), one gather per buffer, in the store, the
        drafter and the rule; with none left the session is empty (the next add starts afresh)."""
        if len(keep) == len(self.rows):
            return
        self.batch.rows = [self.rows[r] for r in keep]
        if not keep:
            self.decoder.spare_store.give(self.cache)
            self.cache = self.pending = self.judge = None
            return
        self.cache.select(keep)
        chooser = self.decoder.chooser
        if chooser is not None and not self._drafters_behind:
            chooser.select(keep)
        self.judge.select(keep)
        self.pending = self.pending[keep]


def _period_model(target):
    """The BMC period model for the target's attention shape (calibrated once per process)."""
    _, kv_heads, head_dim = attention_shape(target)
    return period.machine_model(kv_heads, head_dim, target.dtype)
