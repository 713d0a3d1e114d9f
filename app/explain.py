"""The "How it works" text and the glossary, in the words of DESIGN.md."""

INTRO = """
### Autoregressive (AR) decoding
The **target** (the large model whose output we must reproduce exactly) produces one token per
forward pass. On a CPU or a GPU at batch size 1, that pass is dominated by reading the weights, so
feeding it 8 tokens costs little more than feeding it 1. Speculative decoding exploits exactly that.
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
step). It is strong because it reads **hidden states of the target** (from 5 evenly spaced layers, fused
and injected as extra keys/values). But those hidden states exist only *after* the target has verified
the previous block — so drafter and target must take turns, and each round costs `T_draft + T_verify`.
"""

D3D = """
### D3D: a standalone drafter that can run during verify
The D3D drafter needs **nothing from the target**: it keeps its own causal **context stream** (committed
tokens, its own KV cache — also trained with an auxiliary next-token loss) and drafts blocks that attend
to that context. Because it is independent, it can draft the *next* block **while** the target verifies
this one. It does not yet know how many drafts will be accepted, so it drafts successor blocks for the
`H` most likely **hypotheses** `h = (a, t)` — "`a` drafts will be accepted and the bonus will be `t`" —
in **one packed forward** (a 4-D attention mask keeps the hypotheses apart), scored by its own
probabilities: `P(a, t) ≈ Π_{j≤a} q_j(d_j) · (1 − q_{a+1}(d_{a+1})) · q̃_{a+1}(t)`.

When verify returns `(a*, y)`: a **hit** (some hypothesis equals it) means the next block is already
drafted and the next verify starts at once; a **miss** costs one synchronous draft, as in `d3d-seq`.
Either way every token is still verified by the target, so the mode is lossless whatever the hit rate.
On this CPU the two lanes share two cores (one intra-op thread each); on a GPU they run on two CUDA streams.
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
fine-tune (`python -m d3d_core.prune --heal 1`) then trains the remaining layers with the removed ones
skipped; the curve marks healed points as diamonds, measured against the unpruned drafter fine-tuned
for the same number of steps (the fair reference: a drafter that is not fully trained improves with any
extra training). With `--heal-kd α` the pruned drafter also learns the unpruned drafter's block
distributions (distillation), which kept a little more τ than the target's tokens alone.
The bars on held-out points are 95 % intervals (paired bootstrap over the held-out prompts): even with
a couple of hundred prompts a gap of about a percent can be noise, so "keeps 99 %" is only settled where
the whole bar clears the dotted 99 % line.
"""

GLOSSARY = """
### Glossary (every number the app shows)
| term | meaning |
|---|---|
| **target** | the large causal LM whose output must be reproduced exactly |
| **drafter** | the cheap model that proposes a block of `B` tokens in one pass |
| **block size `B`** | tokens per verify: the anchor plus `B-1` drafts (`ar` uses 1) |
| **round** | one draft + one target verify over the block |
| **anchor** | the last committed token (the previous round's bonus); the block starts with it |
| **accepted `a`** | length of the longest prefix of drafts equal to the target's tokens |
| **bonus** | the target's token right after the accepted prefix; the next anchor |
| **τ (acceptance length)** | mean of `a + 1` over rounds (bonus included) |
| **tokens/s** | output tokens after the first, divided by decode time (prefill excluded) |
| **speedup** | AR time per output token ÷ this mode's time per output token, same prompt, same machine |
| **target fwd** | target forward passes: the prefill plus one verify per round |
| **hypothesis `(a, t)`** | d3d-async's guess of the verify outcome, drafted ahead during verify |
| **H** | how many hypotheses are drafted in the packed pass |
| **hit rate** | share of d3d-async rounds where one hypothesis equalled the verify outcome |
| **overlap share** | share of the drafter's busy time that ran while the target was verifying |
| **idle time** | time a lane (target or drafter) had nothing to do during the run |
| **offline τ** | τ measured by teacher forcing at many anchors, no decoding loop |
| **lossless** | at temperature 0 every mode emits exactly the AR target's tokens |
"""

SECTIONS = [INTRO, DRAFT_VERIFY, DFLASH, D3D, MISS, PRUNING]
