"""The "How it works" text and the glossary, in the words of DESIGN.md."""

from typing import Optional

from d3d_core.measure.costs import forwards_at
from d3d_core.measure.latency import mean_span

INTRO_GENERIC = """
### Autoregressive (AR) decoding
The **target** (the large model whose output we must reproduce exactly) produces one token per
forward pass. On a GPU at batch size 1, that pass is dominated by reading the weights, so feeding it
8 tokens costs little more than feeding it 1 — speculative decoding exploits exactly that. Whether it
holds on *this* machine is measured in the **Benchmarks** tab (*Where the time goes*).
"""


def intro(costs: Optional[dict]) -> str:
    """The AR section, quoting the measured verify(B) / step of the shipped cost breakdown's machine (its
    ``python -m d3d_core.measure.costs``) instead of the GPU rule of thumb."""
    rows = list(forwards_at(costs).values())
    ver = {r["B"]: r for r in rows if r["forward"].startswith("verify(") or r["forward"] == "step"}
    if 1 not in ver or 8 not in ver:
        return INTRO_GENERIC
    cpu = ((costs.get("machine_info") or {}).get("cpu")) or "this CPU"
    d3d = next((r for r in rows if r["forward"].startswith("d3d draft")), None)
    ratios = ", ".join(f"verify({b}) = {ver[b]['per_step']:.2f}" for b in sorted(ver) if b in (2, 4, 6, 8, 16))
    cheap = ver[8]["per_step"] <= 1.25
    engine = {"fast": "fp32"}.get(str(costs.get("engine")), costs.get("engine") or "fp32")
    v8, draft = round(ver[8]["per_step"], 2), round(d3d["per_step"], 2) if d3d else 0.0  # the sum below adds what it prints
    verdict = ("**On the measured CPU it is nearly that cheap, up to a point.**" if cheap else
               "**On the measured CPU it is not that cheap.**")
    return f"""
### Autoregressive (AR) decoding
The **target** (the large model whose output we must reproduce exactly) produces one token per
forward pass. On a GPU at batch size 1 that pass is dominated by reading the weights, so feeding it
8 tokens costs hardly more than feeding it 1 — speculative decoding exploits exactly that.
{verdict} Measured on {cpu} ({ver[1]['threads']} threads; the shipped cost breakdown's machine, not necessarily this server's): one step
costs {ver[1]['wall_ms']:.0f} ms and, in steps, {ratios}; a D3D draft costs
{draft:.2f} steps (the cost of one one-token step, not a share of a verify). So with this table's costs ({engine} engine,
**Benchmarks › Where the time goes**) a `d3d-seq` round of `B = 8` (a draft, then a verify of the whole block) costs
{v8:.2f} + {draft:.2f} = {v8 + draft:.2f} steps: it must commit more than {v8 + draft:.2f} tokens a round (τ) just
to tie `ar` — which is why the engine's **verify plan** (section 2) checks only the drafts likely to pay. A race's own
break-even τ (under each Race column, and in the **Timeline** tab's *Economics of this run*) differs: it divides the
round that race paid by the `ar` step of the same race — another prompt, engine or machine, and each mode's own draft.
"""

VERIFY_PLAN = """
### The verify plan: check only the drafts that pay
A verify over more tokens costs more on a CPU, and a weak drafter's later drafts are rarely reached: the
6th draft only counts if the first five were all right. So with **Verify plan: adaptive** (the fair race's setting; the lesson verifies them all) the
engine verifies a verify width `k` (the anchor and the drafts `d₁ … d_{k-1}`) that maximises *expected tokens per unit of round cost*,
`E[tokens | k] / (T_draft + T_verify(k))` with `E[tokens | k] = 1 + Σ_{j<k} Π_{i≤j} q_i(d_i)` — the
drafter's own probabilities as its acceptance estimate, the bundle's measured cost table (in steps) for
`T_verify(k)`. The drafts from `d_k` on are **held back** (pale yellow cells in **Rounds**): drafted, never verified.
The width depends only on the drafter's side, never on the target's answer, so the output stays exactly
the target's. τ drops a little (a held-back draft can no longer be accepted); time per token drops more.
Choose **full** to verify all `B − 1` drafts, as the method's papers do on GPUs, where a wider verify is
nearly free — with a flat cost table the plan verifies the whole block anyway.
"""

DRAFT_GATE = """
### The draft gate: skip the draft when drafting has not paid lately
A round whose first draft is wrong pays `T_draft + T_verify(k)` for one token — more than the one step `ar`
pays for it. On some prompts that is most rounds (on MT-Bench the shipped drafters' first draft is right
about one time in five). So with **Drafting: gated** (the fair race's setting; the lesson drafts every round):

- the engine tracks what its last 16 drafted rounds earned, in **tokens per step of cost**;
- while that is below what a plain step earns (1 token per step; in `d3d-async` the bar is higher,
  because there a drafted round's verify shares the cores with the packed pass while a skipped round has them
  all — so `d3d-async` skips many more rounds than `d3d-seq` on the same prompts), it **skips the draft**: the target checks the anchor alone, exactly an `ar` step
  (pale blue *no draft* rows in **Rounds**);
- every 4 skipped rounds it drafts once as a **probe** (the wait doubles after each probe that does not pay, up
  to 32); a probe that pays reopens the gate.

The output is still exactly the target's: the decision uses only earlier rounds, and a skipped round commits
the target's own token. On a GPU (flat cost table) a drafted round always earns at least a token per step, so
the gate never closes. **Drafting: always** drafts every round.
"""

DRAFT_VERIFY = """
### Draft, then verify
A cheap **drafter** proposes a **block** of `B` tokens in one pass: `[anchor, d₁ … d_{B-1}]`, where the
**anchor** is the last committed token. The target then **verifies** the whole block in *one* forward and
gives its own token `y_k` at every position. **accepted** `a` = the longest prefix with `d_j = y_j`. The
round commits `d₁ … d_a` plus the **bonus** token `y_{a+1}` (the target's own choice after the accepted
prefix), which becomes the next anchor. So every round yields `a + 1` tokens, between 1 and `B`, and every
token was checked by the target: at temperature 0 the output is *exactly* the AR output (**lossless**);
at temperature > 0 the match rule or standard rejection sampling keeps the target's distribution.
"""

DFLASH = """
### DFlash: a block-diffusion drafter that leans on the target
The DFlash-style drafter fills all `B-1` masked positions in one pass (block diffusion, one denoising
step). It is well informed because it reads **hidden states of the target** from a few of the target's layers — its
**feature layers** (5 evenly spaced ones: in the smollm2-135m bundle, target layers 1, 8, 14, 20 and 27 of 30), fused and injected as
extra keys/values. Its own stack is separate and small: its **drafter layers** (2 in this CPU bundle — the Race
tab's "2 drafter layers"; 5 in the public Qwen3-8B DFlash drafter the GPU profiles model). But those hidden
states exist only *after* the target has verified the previous block — so drafter and target must take turns,
and each round costs `T_draft + T_verify`.

**Comparing `dflash` with `d3d-*` here is not a clean comparison of methods:** this bundle's D3D drafter has
8 drafter layers against DFlash's 2, so their τ and their draft cost differ by drafter size as well as by
method (a confound the race does not remove).
"""

D3D = """
### D3D: a standalone drafter that can run during verify
The D3D drafter needs **nothing from the target**: it keeps its own causal **context stream** (committed
tokens, its own KV cache — also trained with an auxiliary next-token loss) and drafts blocks that attend
to that context. The shipped drafter reads draft 1 from the **anchor's own slot** (its next-token output,
the same weights the auxiliary loss trains, fine-tuned with draft 1 supervised there), which is right more often than
the first MASK slot (41 % against 33 % on 192 held-out prompts); drafts 2.. come from the MASK slots. On a CPU
its MLPs and head run in **int8**: a draft only proposes and the target checks every token, so this cannot
change the output; it makes a draft about 30 % cheaper for under 2 % of τ. Because it is independent, it can draft the *next* block **while** the target verifies
this one. It does not yet know how many drafts will be accepted, so it drafts successor blocks for the
`H` most likely **hypotheses** `h = (a, t)` — "`a` drafts will be accepted and the bonus will be `t`" —
in **one packed forward** (a 4-D attention mask keeps the hypotheses apart), scored by its own
probabilities: `P(a, t) ≈ Π_{j≤a} q_j(d_j) · (1 − q_{a+1}(d_{a+1})) · q̃_{a+1}(t)`, where `q_j` is the
drafter's distribution at block position `j` and `q̃_{a+1}` is `q_{a+1}` with the rejected draft
`d_{a+1}` removed and renormalised (a rejection means the target chose something else there). When every draft is
accepted (`a = B − 1`) there is no rejected draft: the middle factor drops out and `t` is scored with the drafter's
extra *lookahead* slot past the block. A low-scored hypothesis can still be the one that hits: the scores rank the
drafter's guesses, and it is often unsure.

When verify returns `(a*, y)`: a **hit** (some hypothesis equals it) means the next block is already
drafted and the next verify starts at once; a **miss** costs one synchronous draft, as in `d3d-seq`.
Either way every token is still verified by the target, so the mode is lossless whatever the hit rate.
On this CPU the two lanes share two cores (one intra-op thread each); on a GPU they run on two CUDA streams.

**Why d3d-async often loses to d3d-seq here.** Overlap is free only when the drafter runs on hardware the target is
not using. On two CPU cores both lanes share the cores and the memory bus, so the packed pass slows the verify it runs
beside (the Timeline tab's caption says by how much in your race), every miss still adds a sync draft, and a drafter
as cheap as this one (a draft is a fraction of a verify) has little to hide. Overlap pays once a draft costs a large
share of a verify — the Benchmarks tab's *overlap* section measures where that happens on this CPU — and on a GPU,
where the two lanes run side by side (the Timeline's GPU clocks and Projections model that; they are not measurements).
"""

MISS = """
### What a miss costs
A sequential round costs `T_draft + T_verify`. An async round costs about `max(T_verify, T_packed)` on a
hit and that plus `T_draft` on a miss. The packed pass grows with `H`, so more hypotheses raise the hit
rate but make every round's drafter work larger — the Timeline tab shows both lanes and where each waits.
"""

PRUNING = """
### What pruning trades
Skipping a drafter layer passes its residual stream through unchanged: the draft gets cheaper, but the
drafts may match the target less often. **Offline τ** measures that quickly without decoding: teacher-force
the target's own greedy continuation, draft a block at many anchors, count leading matches + 1. The
greedy progression drops, at each step, the layer whose removal costs the least τ. A short **healing**
fine-tune (`python -m d3d_core.training.prune --heal 1`) then trains the remaining layers with the removed ones
skipped; a curve made that way marks its healed points as diamonds, measured against the unpruned drafter
fine-tuned for the same number of steps (the fair reference: a drafter that is not fully trained improves with
any extra training). A curve made without `--heal` has no diamonds, and the **Pruning** tab says so. What a
removed layer saves is drawn on the curve too: the draft time saved, in ms, from the shipped cost breakdown (measured on the CPU the Benchmarks tab names, not necessarily this one). With `--heal-kd α` the pruned drafter also learns the unpruned drafter's block
distributions (distillation), which kept a little more τ than the target's tokens alone.
The bars on held-out points are 95 % intervals (paired bootstrap over the held-out prompts): even with
a couple of hundred prompts a gap of about a percent can be noise, so "keeps 99 %" is only settled where
the whole bar clears the dotted olive line: 99 % of the full drafter's *held-out* τ (the dashed grey line is 99 % of
its calibration τ, for the calibration curve).
"""

DEPTH = """
### A deeper drafter: more τ, not more speed
The default D3D drafter has 8 layers. **`d3d-deep`** (the Race tab's *D3D drafter* picker) runs all 30 of the
target's layers, frozen, plus small trained **adapters** (rank 64, 9 MB) that act only on the MASK slots. Its
anchor slot computes exactly what the target computes, so **draft 1 is always the target's own next token**;
the MASK slots learn the rest.
But each draft now reads every layer's weights, as a target step does: **on this CPU a draft costs almost as much as
a verify**@DEEP_COST@, so a round costs nearly two verifies.@DEEP_BENCH@
Race both drafters on one prompt and compare the τ and tokens/s counters, then the draft spans in the
**Timeline** tab. On a GPU a draft through all 30 layers still reads every layer's weights, so at batch size 1
it costs about one verify there too — not a fraction of one. What a GPU can change is the overlap: on its own
stream, with bandwidth to spare, such a draft may hide behind verify (the regime the D3D preprint's full-depth
drafters aim at). Whether it pays is not measured here: the **Benchmarks** tab's *Projections* (GPU profiles) project it from a
latency model, and only a GPU run can settle it.
"""

START = """
### How it works, one short section at a time
Read the sections in the row of tabs above from left to right; each takes a minute and answers one question:

1. **Draft, then verify**: what a round is, and why every mode prints exactly the target's tokens
2. **Verify plan, draft gate**: why, on this CPU, some drafts are never checked and some rounds draft nothing
3. **DFlash**: a drafter that must wait for the target
4. **D3D during verify**: drafting the next block while the target checks this one, and what a miss costs
5. **A deeper drafter**: more τ is not more speed
6. **Skipping drafter layers**: what pruning trades

**Which τ is which** and the **Glossary** explain every number the app shows, and **Words** the method's terms. Then check each answer on your own
race: the table below names the tab that shows it.
"""

GLOSSARY = """
### Glossary (every number the app shows)
| term | meaning |
|---|---|
| **target** | the large causal LM whose output must be reproduced exactly |
| **drafter** | the cheap model that proposes a block of `B` tokens in one pass |
| **block size `B`** | tokens per drafted block: the anchor plus `B-1` drafts (`ar` uses 1); the verify checks all of them (*full*) or the prefix the verify plan picks (*adaptive*) |
| **draft gate / no draft** | *gated*: skip the draft, verifying the anchor alone like `ar`, while the drafted rounds have lately earned fewer tokens per step of cost than a plain step; a probe draft every few skipped rounds |
| **verify plan / held back** | *adaptive*: verify only the drafts expected to pay for the wider verify on this bundle's cost table; the drafts past that width are *held back* (drafted, never verified) |
| **round** | one draft + one target verify over the block (its time in ms: *round (ms)* below) |
| **anchor** | the last committed token (the previous round's bonus; in round 0, the token the prefill produced); the block starts with it; its *position* counts the prompt's tokens and every output token before it |
| **accepted `a`** | length of the longest prefix of drafts equal to the target's tokens |
| **after the mismatch** | drafts past the first mismatch: the verify computed the target's token there too (its forward reads the whole block), but a draft after a wrong one cannot count, so they are discarded (near-white cells in **Rounds**) |
| **bonus** | the target's token right after the accepted prefix; the next anchor |
| **τ (acceptance length)** | mean of `a + 1` over rounds (bonus included) |
| **tokens/s** | output tokens after the first, divided by decode time (prefill excluded) |
| **finish** | why a run ended: `eos` (the model printed its end-of-text token: the answer is complete), `length` (it reached *Max new tokens*), `cancelled` (stopped) |
| **speedup** | AR time per output token ÷ this mode's time per output token, same prompt, same machine |
| **target fwd** | target forward passes: the prefill plus one verify per round |
| **hypothesis `(a, t)`** | d3d-async's guess of the verify outcome, drafted ahead during verify |
| **score P(a,t)** | the Rounds tab's hypotheses table: the drafter's own estimate that the verify accepts `a` drafts and its bonus is `t`; only the `H` likeliest are listed, so the scores need not add up to 1, and the hit can be a low-scored one |
| **H** | how many hypotheses are drafted in the packed pass |
| **hit rate** | share of d3d-async rounds (all but the last, which has no verdict) where one hypothesis was the verify's outcome; a hit can have `a = 0` (only the bonus guessed), so τ 1.00 can come with hits |
| **overlap share** | share of the drafter's busy time that ran while the target was verifying (the Benchmarks table's *overlap* is the same share, over the bench's runs) |
| **lossless_rate** | Benchmarks table: share of the bench's answers identical to `ar`'s (1.0: every one) |
| **skipped** | Benchmarks table: share of rounds the draft gate left without a draft (each an `ar` step) |
| **machine bound** | Benchmarks › *Where the time goes*, black diamond: a forward's bytes at the measured copy speed or its FLOPs at the measured GEMM rate, whichever is longer — a yardstick, not a floor |
| **idle time** | time a lane (target or drafter) had nothing to do during the run |
| **offline τ** | τ measured by teacher forcing at many anchors, no decoding loop |
| **lossless** | at temperature 0 every mode emits exactly the AR target's tokens |
| **match rule** | the default verify rule at temperature > 0: accept drafts while they equal the target's own samples (lossless); *rejection* (accept `d` with probability `min(1, p/q)`) accepts more often |
| **T_step** | what `ar` paid per token in the same race: its decode time ÷ its tokens (one step's forward + its own bookkeeping); the yardstick of every "N ar steps", speedup and break-even τ |
| **T_verify(B), T_draft, T_packed** | mean span of one verify of `B` tokens, one draft, one packed pass — from the run's own spans |
| **round (ms)** | decode time ÷ rounds = verify + draft not hidden (drafting the target waited for) + other (neither lane busy); the parts add up to the round |
| **break-even τ** | round ÷ T_step: the τ at which a mode, with the round costs it paid, would tie `ar` here — the same number as "a round costs N ar steps" |
| **offline τ vs the race's τ** | offline τ: teacher forcing at many fixed anchors; the race's τ: the rounds of one decode — they agree on average over many prompts, not per prompt |
"""

WORDS = """
### Words (the method's terms, in plain language)
| term | meaning |
|---|---|
| **D3D** | the method this app is built around, from the D3D preprint (Chen et al., 2026): a *standalone* block-diffusion drafter that reads only tokens, so it can draft the next block while the target is still verifying this one |
| **DFlash** | the published target-conditioned block-diffusion drafter (arXiv 2602.06036): it reads the target's hidden states, so it must wait for each verify |
| **block diffusion** | drafting a whole block at once: the drafter fills `B − 1` *MASK slots* (placeholder positions) after the anchor in one pass, instead of one token per pass |
| **hidden states / feature layers** | the target's internal vectors at some layers (its *residual stream*); DFlash's drafter reads them, D3D's does not |
| **prefill** | the target's first forward over the whole prompt at once: it fills the KV cache and yields the first output token (pink in the Timeline); every mode starts with it, so tokens/s leave it out |
| **<code>&lt;&#124;im_end&#124;&gt;</code>** | the model's end-of-answer token: printing it ends the answer (*finish = eos*) |
| **gsm8k, mt_bench, …** | public benchmark prompt sets (school maths, multi-turn chat, code, …) the bench draws its prompts from |
| **teacher forcing** | scoring drafts against the target's own continuation at fixed positions, without running the decode loop (how offline τ and training work) |
| **healing** | a short re-training of a pruned drafter so the layers left make up for the removed ones (`prune --heal`) |
| **GGUF, Q4_1** | llama.cpp's model file format, and its 4-bit block format (32 weights share a scale and an offset): the int4 engine computes from these blocks |
| **int8, int4** | numbers stored in 8 or 4 bits instead of 32: a weight block keeps a scale (and an offset), so the model reads fewer bytes per step; the drafter's int8 layers and the int4 engine both use this |
| **AVX2, AVX-512, VNNI** | generations of a CPU's vector instructions (how many numbers one instruction multiplies); kernels differ by them, so the app names each figure's CPU |
| **lookahead slot** | one more MASK slot past the block, read only to score the bonus `t` of the hypothesis "every draft accepted" |
| **prompt lookup** | a drafter-free speculative method: it drafts by copying the tokens that followed the same n-gram earlier in the context (Hugging Face's and llama.cpp's built-in ones are the Benchmarks' peers) |
| **paired bootstrap** | an interval for a ratio of τ (pruned ÷ full) from resampling the same prompts for both, so prompt-to-prompt differences cancel |
| **row plan** | which matrix-multiply routine the engine uses for each number of rows (tokens) in a forward, chosen by measuring them at set-up |
| **presenter view** | the 🖥 Presenter checkbox (or `?presenter` in the address): larger type for a projector |
| **bf16, HBM** | a 16-bit float format GPUs compute in; a GPU's high-bandwidth memory (its speed sets a GPU's decode step) |
| **denoising step** | a diffusion model turns noise (here: MASK slots) into output over one or more passes; each pass is a step, and these drafters take exactly one |
| **residual stream** | the running vector each layer of a transformer adds its output to; a skipped (pruned) layer adds nothing, so the stream passes through it |
| **rank-64 adapters** | small trained weight matrices (two thin factors of width 64) added to a frozen layer, instead of training the layer itself |
| **KV cache, KV writes** | the keys and values each layer computed for earlier tokens, kept so a new token attends to them without recomputing; a *write* stores the new ones |
| **4-D attention mask** | a mask of shape (batch, heads, queries, keys) saying which positions each position may attend to: it keeps d3d-async's hypotheses apart in one pass |
| **RoPE** | rotary position embedding: each token's position rotates its query and key vectors |
| **GEMM, BLAS, oneDNN** | a general matrix multiply (most of a forward's time); BLAS and oneDNN are the CPU libraries torch runs them with |
| **intra-op thread** | a thread that works inside one operation (e.g. splits a GEMM); d3d-async gives each lane one of the two cores |
| **CUDA stream** | a GPU work queue; work on two streams can run at the same time, as d3d-async's two lanes would on a GPU |
| **temperature, rejection sampling** | temperature 0 always takes the most likely token (greedy, the app's default); above 0 it samples. There a draft `d` is kept with probability `min(1, p(d)/q(d))` (target's probability over the drafter's), which keeps the target's own distribution |
"""

QUESTIONS = """
### Questions your own run answers
Run a race (the default prompt is one where the shipped drafters do well), then:

| question | where to look |
|---|---|
| **What is τ?** | **Race** tab: each column's `τ` counter; **Acceptance** tab: tokens each round committed, `a + 1` (1 … B: the accepted drafts plus the bonus), the same convention as the Benchmarks histogram; the *Which τ is which* section says why the app shows several |
| **Why must the DFlash-style drafter wait?** | **Timeline** tab: on the `dflash` lanes every draft starts only after the previous verify ended — it needs that verify's hidden states |
| **What does D3D draft during verify?** | **Rounds** tab, mode `d3d-async`: the hypotheses table lists the `(a, t)` guesses drafted while the target verified that round, and which one hit |
| **What does a miss cost?** | **Timeline** tab: a ✗ at the end of a verify is followed by a vermillion (red-orange) *sync draft* span the target waits for; its *Economics of this run* bar shows it as *draft not hidden* |
| **Why do some rounds have no draft?** | **Rounds** tab: pale blue *no draft* rows are rounds the draft gate skipped — drafting had lately earned less than one token per step of cost, so the round was a plain target step; run with *Drafting: always* (Race tab, under *Verify plan, drafting and sampling*) to compare the tokens/s counters |
| **Why were some drafts never checked?** | **Rounds** tab: pale yellow cells are drafts the verify plan *held back* — a wider verify costs more here than those unlikely drafts were expected to earn; run with *Verify plan: full* (the same place) to see the difference in the τ and tokens/s counters |
| **Why is a bigger block not always faster here?** | **Benchmarks** tab: verify(B) in steps grows with B on this CPU (*Where the time goes*) while τ saturates (*Acceptance and block size*) |
| **What does pruning trade?** | **Pruning** tab: each removed layer's τ cost on the curve, and the milliseconds of draft time it saves (the orange dashed line, right axis; from the shipped cost breakdown's CPU, named in Benchmarks) |
| **Does a drafter that guesses more make decoding faster?** | **Race** tab, *D3D drafter*: race `d3d-deep`, then the default, on one prompt — τ rises, tokens/s need not; **Timeline** tab: its draft spans are about as long as a verify |
| **Would this be faster on a GPU?** | **Timeline** tab, *Clock*: re-time your run under a GPU profile of the latency model (projected, labelled as such) |
"""

WHICH_TAU = """
### Which τ is which (and which T_step)
The app shows several τ for the same D3D drafter. They are all "tokens per round" — they differ in **which
prompts**, **how they are counted** and **which rounds count**:

| τ | where | measured how | why it differs |
|---|---|---|---|
| **offline τ, calibration** | Pruning curve (solid), live τ | teacher-forced at many anchors of the calibration prompts, block 8, no decoding | the prompts the layers were chosen on: optimistic |
| **offline τ, held-out** | Pruning curve (dotted) | the same measurement on prompts never trained or chosen on | the honest offline number: lower |
| **bench τ** | Benchmarks table | real decoding (10 prompts per dataset, 128 tokens), every round counted | a round the draft gate skipped counts `a + 1 = 1`; the verify plan may cap `a` |
| **τ per drafted round** | Benchmarks histogram | the same bench, drafted rounds only, pooled over the chosen datasets | undrafted rounds left out (higher), datasets pooled (MT-Bench pulls it down) |
| **the example chips' τ** | Race tab, *Examples* | d3d-seq, drafting every round, the first 96 new tokens of that prompt | fewer tokens than a full answer: the lesson race runs to the end (176 at most), where the harder tail lowers it |
| **this race's τ** | Race columns, Acceptance, Timeline | one decode of *your* prompt | one prompt: the default math prompt is an easy one |
| **quoted τ** | this page's text (e.g. *A deeper drafter*'s τ) | a shipped bench run, read from its file | re-measured only when that bench is re-run |
| **T_draft, d3d-seq vs d3d-async** | Race columns, Timeline | mean draft span on the critical path | d3d-seq's draft also writes the tokens the last round committed into the drafter's cache (up to `B` more rows); in d3d-async the packed pass already wrote them, so its sync draft after a miss is a little shorter |
| **d3d-seq's τ vs d3d-async's** | Race columns | the same drafter, the same prompt | on either engine the drafter runs its MLPs and head in int8 (the Engine choice is the target's), and int8 scales each batch of rows as a whole; d3d-async drafts in other batches (a packed pass holds several guesses; a miss drafts again), so where the drafter is unsure the two modes guess differently at the same position; once one round accepts a different number of drafts the blocks start at different places and the two τ drift apart — either may be higher. A server started with `D3D_DRAFTER_INT8=off` (a setting of the server, not of this page) drafts in fp32, and there both modes draft the same block at every shared position and their τ agree |

The same for time: **T_step** in the race is what `ar` paid per token *in that race* — its forward plus its own
bookkeeping, at that prompt's context length, under whatever else the machine was doing; the **Benchmarks**
cost breakdown's *step* is one forward alone, median of several, at a fixed 300-token context on a quiet
machine. The race's is the one its break-even τ and its speedups use; the two differ (another run, another
context length, often another machine), in either direction.
"""

def depth(costs: Optional[dict], deep_benches: list = (), engine_bench: Optional[dict] = None) -> str:
    """The deeper-drafter section, with the shipped cost breakdown's overlap probe at depth 30 when it has one, and
    the whole d3d-deep's shipped bench (``service.deep_benches``) beside the 8-layer drafter's bench on the same engine
    (``engine_bench``) when they are shipped."""
    whole = next((b for b in deep_benches if not str(((b.get("config") or {}).get("skip_layers")) or "")), None)
    row = next((r for r in ((costs or {}).get("overlap") or {}).get("rows") or [] if r.get("depth") == 30), None)
    bench = ""
    seq, asy = (_avg(whole, m) if whole else None for m in ("d3d-seq", "d3d-async"))
    if seq and asy:
        m = whole.get("machine") or {}
        eng = {"fast": "fp32"}.get(str((whole.get("config") or {}).get("engine")), (whole.get("config") or {}).get("engine"))
        bench = (f" In its bench (the Pruning tab with `d3d-deep` picked, *Raced*: {m.get('cpu', 'an unrecorded CPU')}, {eng} engine"
                 + (f", {m['date'][:10]}" if m.get("date") else "") + f") `d3d-seq` with it reached τ **{seq['tau']:.2f}** "
                 f"(the mean over its datasets) and ran at **{seq['speedup']:.2f}×** `ar`, `d3d-async` {asy['speedup']:.2f}×")
        eight = _avg(engine_bench, "d3d-seq") if engine_bench else None
        if eight:
            bench += (f", where the 8-layer drafter's `d3d-seq` reached τ {eight['tau']:.2f} and {eight['speedup']:.2f}× in that "
                      "engine's bench (also the mean over its datasets)")
        draft = _span(whole, "d3d-seq", "draft")
        probe_b = ((costs or {}).get("overlap") or {}).get("B", 8)  # the overlap probe's block (its draft fills B − 1 slots)
        probe_ms = f" ({row['draft_ms']:.0f} ms)" if row else ""
        bench += (". Its τ counts the rounds the draft gate left undrafted as 1" + (", so it sits below 2 although every drafted "
                  "round keeps at least 2 tokens" if seq["tau"] < 2 else "") + (f"; and a draft in that bench took {draft:.0f} ms, more than the probe's one "
                  f"draft of a block of {probe_b} tokens{probe_ms}, because behind the gate a draft first runs every token committed since the drafter's last "
                  "draft through its 30 layers" if draft else "")
                  + ". On two cores each lane slows the other, and a draft as long as a verify cannot hide behind it."
                  + (f" (The overlap probe reads a 30-layer async round at {row['async_over_seq']:.2f}× d3d-seq's speed, but it "
                     "packs one hypothesis that always hits; the bench packs H = 4, a pass several drafts long, and misses "
                     "often.)" if row and row.get("async_over_seq") else ""))
    step = forwards_at(costs).get("step")
    steps = f", {row['draft_ms'] / step['wall_ms']:.1f} one-token steps of {step['wall_ms']:.0f} ms" if row and step else ""
    cost = (f" (Benchmarks › *Where the time goes*, the overlap probe: a 30-layer draft takes {row['draft_ms']:.0f} ms{steps}, "
            f"a verify({costs['overlap'].get('B', 8)}) {row['verify_ms']:.0f} ms)") if row else ""
    return DEPTH.replace("@DEEP_COST@", cost).replace("@DEEP_BENCH@", bench)


SECTIONS = [DRAFT_VERIFY, VERIFY_PLAN, DRAFT_GATE, DFLASH, D3D, MISS, depth(None), PRUNING]


def pruning_story(shallow: dict | None, deep: dict | None, deep_benches: list = ()) -> str:
    """How it works' pruning story told with the shipped curves' own figures (``assets/pruning/``): what the cheapest
    layer of each drafter costs, how many layers each can lose within 99 % of its held-out τ, and why the two differ —
    or that a curve is not shipped; with ``deep_benches`` (``service.deep_benches``) also what racing the pruned deep
    drafter changed for d3d-seq and d3d-async. Pure: the same curves always tell the same story."""
    def first(c):
        pts = (c or {}).get("curve") or []
        return pts[1] if len(pts) > 1 else None

    def within(c):
        pts = [p for p in (c or {}).get("curve") or [] if p.get("tau_eval_rel", p["tau_rel"]) >= 0.99]
        return max(p["removed"] for p in pts) if pts else 0

    def pct(p, key):
        return f"{p[key]:.1%}" if p and p.get(key) is not None else "–"

    def ci(p):
        c = (p or {}).get("tau_eval_rel_ci")
        return f" (95 % interval {c[0]:.1%}–{c[1]:.1%})" if c else ""

    def healed_words(c):  # what the curve's healed points say, or that healing was not run on it
        pts = [p for p in (c or {}).get("curve") or [] if p.get("healed")]
        if not pts:
            return " (not run on this curve: `prune --heal` needs distillation data)"
        ref = "the unpruned drafter fine-tuned alike" if c.get("heal_reference") == "heal_control" else "the unpruned drafter"
        said = []
        for p in pts:
            h = p["healed"]
            kd = f", distilling from the unpruned drafter α {h['kd_alpha']}" if h.get("kd_alpha") else ""
            said.append(f"with {p['removed']} removed, {h['steps']} steps{kd}: {pct(h, 'tau_eval_rel')} of {ref}{ci(h)}, "
                        f"from {pct(p, 'tau_eval_rel')} before")
        return " — measured: " + "; ".join(said)

    out = ["### Pruning a deep drafter, with this bundle's curves",
           "The D3D preprint prunes a 36-layer drafter by each layer's effect on acceptance and keeps over 99 % of τ with "
           "5 layers removed. Here, measured the same way (greedy, offline τ, held-out prompts never used to choose):"]
    for name, c, what in (("the 8-layer D3D drafter", shallow, "d3d"), ("`d3d-deep` (the target's 30 layers + adapters)", deep, "d3d-deep")):
        p = first(c)
        if p is None:
            out.append(f"- **{name}**: no pruning curve is shipped (`python -m d3d_core.training.prune --drafter {what}`).")
            continue
        L = c["layers"]
        layer = c["order"][0]
        out.append(f"- **{name}**: removing its cheapest layer (layer {layer}, 1 of {L}: {1 / L:.0%} of its layers) keeps "
                   f"{pct(p, 'tau_rel')} of τ on the calibration prompts and {pct(p, 'tau_eval_rel')} held-out{ci(p)}; "
                   f"**{within(c)}** layer{'s' if within(c) != 1 else ''} can go within 99 % of held-out τ.")
    if first(deep) is not None:
        if within(deep) == 0:
            out.append(
                "Why the deep drafter does not keep its τ here: its anchor slot computes exactly the target's prediction "
                "only while **every** target layer runs — that is why its draft 1 is always the target's token. Skip any "
                "layer and the context rows' keys and values and the anchor's output all change, so draft 1 can be wrong, "
                "and the adapters act on the MASK slots only: they cannot repair the context rows or the anchor slot, and "
                f"healing retrains only them{healed_words(deep)}. "
                "A likely reason the preprint's result differs: a deep drafter trained as a drafter has depth to spare, "
                "while a 135 M target's 30 narrow layers each carry part of its own prediction. What a removed layer buys "
                "is small too: one of 30 layers is about 3 % of the draft's layers, so a layer must cost less than about "
                "3 % of τ to pay for itself.")
        else:
            out.append(f"As in the preprint, the deep drafter has layers to spare: {within(deep)} of {deep['layers']} go "
                       "within 99 % of its held-out τ, each saving a share of every draft.")
    rows = deep_race(list(deep_benches))
    full = {r["mode"]: r for r in rows if not r["skip"]}
    raced = [(full[r["mode"]], r) for r in rows if r["skip"] and r["mode"] in full]
    if raced:
        said = "; ".join(f"`{r['mode']}` {f['speedup']:.2f}× → **{r['speedup']:.2f}×** `ar` (τ {f['tau']:.2f} → {r['tau']:.2f}"
                         + (f", a draft {f['draft_ms']:.1f} → {r['draft_ms']:.1f} ms" if f["draft_ms"] and r["draft_ms"] else "") + ")"
                         for f, r in raced)
        out.append(f"**Raced** (the Pruning tab with `d3d-deep` picked, its *Raced* table: without layer(s) {raced[0][1]['skip']}): {said}. "
                   "In `d3d-async` the removed layers also leave the packed pass, which runs beside the verify on the same "
                   "cores: a shorter pass slows the verify for less time, so the overlap gains what the draft saved plus some of "
                   "the verify's slowdown, while the lower τ costs every round."
                   + "".join(" " + w for w in (gate_words(f, r) for f, r in raced if r["mode"] == "d3d-seq") if w))
    return "\n\n".join(out)


def _avg(result: dict, mode: str) -> Optional[dict]:
    """A bench result's pooled ('average') summary row of ``mode``."""
    return next((s for s in result.get("summary") or [] if s.get("mode") == mode and s.get("dataset") == "average"), None)


def _span(result: dict, mode: str, span: str) -> Optional[float]:
    """The mean ms of one span kind (draft, verify, step) of ``mode`` over a bench run's rows, weighted by count."""
    return mean_span([r for r in result.get("rows") or [] if r.get("mode") == mode], span)


def deep_race(benches: list) -> list:
    """One row per (bench, drafting mode) of the deep drafter's shipped benches (``service.deep_benches``): which layers
    it skipped, τ and speed against ``ar`` pooled over the run's datasets, the mean draft and verify ms, ar's step ms and
    whether every answer equalled ar's. Pure."""
    out = []
    for b in benches:
        skip = str(((b.get("config") or {}).get("skip_layers")) or "")
        step = _span(b, "ar", "step")
        for mode in ("d3d-seq", "d3d-async"):
            row = _avg(b, mode)
            if not row:
                continue
            rs = [r for r in b.get("rows") or [] if r.get("mode") == mode and r.get("rounds") and r.get("tau") is not None]
            n, k = sum(r["rounds"] for r in rs), sum(r.get("skipped_rounds") or 0 for r in rs)
            # a skipped round commits its bonus alone (a + 1 = 1): τ per drafted round leaves those rounds out
            drafted = (sum(r["tau"] * r["rounds"] for r in rs) - k) / (n - k) if n > k else None
            out.append({"skip": skip, "mode": mode, "tau": row["tau"], "speedup": row["speedup"],
                        "lossless": row["lossless_rate"], "draft_ms": _span(b, mode, "draft"),
                        "verify_ms": _span(b, mode, "verify"), "step_ms": step,
                        "skipped": k / n if n else None, "tau_drafted": drafted})
    return out


def gate_words(full: dict, pruned: dict) -> str:
    """Why removing layers cut the deep drafter's τ more than its speed, from two ``deep_race`` rows of one mode: the
    draft gate skipped more rounds (each an ar step that counts 1 in τ), while τ per drafted round fell less. ""
    without the per-prompt rows to read that from."""
    if full.get("skipped") is None or pruned.get("skipped") is None or not full.get("tau_drafted") or not pruned.get("tau_drafted"):
        return ""
    return (f"Why τ fell more than the speed: the draft gate skipped {full['skipped']:.0%} → {pruned['skipped']:.0%} of "
            f"`{full['mode']}`'s rounds (all prompts pooled), and τ counts each skipped round as 1 (it is a plain `ar` step), "
            f"while per drafted round τ went only {full['tau_drafted']:.2f} → {pruned['tau_drafted']:.2f}; with most rounds plain steps the "
            "speed stays near `ar`'s either way, and each draft, catching up on the rounds skipped before it, saved little.")


def deep_race_text(benches: list, provenance: str = "") -> str:
    """The Pruning tab's 'raced' section for d3d-deep: the whole and the pruned drafter in the shipped benches, as a
    table, then what removing the layers bought (draft ms, τ, speed). "" when no deep bench is shipped."""
    rows = deep_race(benches)
    if not rows:
        return ""
    def ms(x):
        return f"{x:.1f}" if x is not None else "–"
    lines = ["**Raced, whole and pruned** (`bench --d3d-drafter d3d-deep [--skip-layers …]`; speed against `ar` in the same run, "
             "the mean of its datasets' rows; *same as ar*: share of answers identical to ar's)",
             "", "| d3d-deep | mode | τ | speed vs ar | draft ms | verify ms | same as ar |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        name = f"without L{r['skip'].replace(',', ', L')}" if r["skip"] else "all 30 layers"
        lines.append(f"| {name} | {r['mode']} | {r['tau']:.2f} | {r['speedup']:.2f}× | {ms(r['draft_ms'])} | {ms(r['verify_ms'])} | "
                     f"{r['lossless']:.0%} |")
    full = {r["mode"]: r for r in rows if not r["skip"]}
    pruned = [r for r in rows if r["skip"] and r["mode"] in full]
    said = []
    for r in pruned:
        f = full[r["mode"]]
        if r["draft_ms"] and f["draft_ms"]:
            saved = (f["draft_ms"] - r["draft_ms"]) / f["draft_ms"]
            said.append(f"{r['mode']}: a draft {f['draft_ms']:.1f} → {r['draft_ms']:.1f} ms "
                        f"({abs(saved):.0%} {'less' if saved >= 0 else 'more, although layers were removed'}), "
                        f"τ {f['tau']:.2f} → {r['tau']:.2f}, "
                        f"speed {f['speedup']:.2f}× → {r['speedup']:.2f}× ar")
    if said:
        lines += ["", "Removing the layers: " + "; ".join(said) + ". *draft ms* is a bench draft's mean: behind the draft "
                  "gate a draft first runs every token committed since the drafter's last draft, so it grows with the rounds "
                  "the gate skipped, and a few % between two runs is noise; τ counts skipped rounds as 1."]
        why = next((w for w in (gate_words(full[r["mode"]], r) for r in pruned if r["mode"] == "d3d-seq") if w), "")
        if why:
            lines += ["", why]
    if provenance:
        lines += ["", provenance]
    return "\n".join(lines)


def pruning_round(costs: Optional[dict], draft_ms: Optional[float], per_layer_ms: Optional[float], removed: int,
                  what: str = "a draft") -> str:
    """What removing ``removed`` drafter layers does to a d3d-seq round of B = 8 on the cost table's machine (its most
    threads): the draft shrinks by ``removed`` × ``per_layer_ms``, the round (draft + verify(8)) by the same ms, so
    break-even τ = round / step falls by that share — and pruning pays only while τ falls by less. Pure; "" without
    the figures."""
    by = forwards_at(costs)
    step, v8 = (by.get(f, {}).get("wall_ms") for f in ("step", "verify(8)"))
    if not draft_ms or not per_layer_ms or removed <= 0 or not step or not v8:
        return ""
    saved = min(removed * per_layer_ms, draft_ms)
    before, after = (draft_ms + v8) / step, (draft_ms - saved + v8) / step
    return (f" · saves about **{saved:.1f} ms per draft** ({saved / draft_ms:.0%} of {what}'s {draft_ms:.0f} ms, "
            f"{per_layer_ms:.1f} ms a layer) on the cost table's machine: d3d-seq's round of B = 8 (draft + verify(8) "
            f"{v8:.0f} ms) goes from {before:.2f} to {after:.2f} steps of {step:.0f} ms, its **break-even τ** falls "
            f"{1 - after / before:.1%} — so pruning pays only if τ falls by less than that")
