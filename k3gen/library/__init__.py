"""k3gen's kernels as torch.library custom ops in the `k3gen::` namespace.

Importing this package registers the ops (it needs torch, never the CUDA driver: a kernel is
resolved and loaded on its first CUDA call, or by `k3gen.api.prepare`). `import k3gen` alone does
not import it. The stable, documented entry points are `k3gen.api`; the ops are what a graph
records (torch.compile, torch.export) and what an engine registers.

Every op takes the kernel handle (`table.handle_of(spec)`: the spec's canonical JSON) first, has
a fake implementation that computes its outputs' shapes from the spec and the inputs (and checks
them, raising SpecError), declares what it mutates, and comes as a functional op returning fresh
outputs plus an `_out` op writing caller-owned buffers (kv_cache_write only mutates).

| op | mutates |
| --- | --- |
| act_quant_fp8(h, x) -> (codes, scales) | (_out: codes, scales) |
| fp8_block_gemm(h, x_codes, x_scales, w_codes, w_scales) -> out | (_out: out) |
| kda_decode(h, qkvg, fa, beta_logit, ssm, conv, slots, conv_w, fb_w, dt_bias, a_log, norm_w) -> out | ssm, conv |
| kda_prefill(h, qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, weights...) -> out | ssm, conv |
| kda_verify(h, qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, weights...) -> out | ssm, draft_rec, conv_ext |
| kv_cache_write(h, rows, cu_rows, start_pos, block_table, cache[], ring_slot?, scale, max_rows_per_seq) | cache[] |
| mla_decode(h, q, cache[], block_table, lengths, ring_slot?, scale, splits, part_o?, part_lse?) -> out | part_o, part_lse |
| mla_q_absorb(h, q_a, norm_w, wqb_codes, wqb_scales, w_uk) -> out | (_out: out) |
| mla_vb_gate(h, o_lat, w_uv, gate) -> out | (_out: out) |
| moe_route(h, logits, bias) -> (ids, weights, counts, offsets, perm, inv) | (_out: the six, a T_max workspace) |
| attn_res(h, src, n, query, norm_w, delta?, seal, want_mixed) -> (out, codes, scales, mixed) | src (_out: + codes?, scales?, mixed?, out) |
| glu_act(h, gu) -> (codes, scales) | (_out: codes, scales) |
| router_logits(h, x, w) -> out | (_out: out) |
| mla_prefill(h, q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q) -> out | (_out: out) |
| moe_experts(h, x, w13, s13, w2, s2, ids, weights, offsets, perm, gs13?, gs2?, x_scales?, expert_base, ws_h?, ws_y?, want_f32) -> (out, out_f32) | ws_h, ws_y (_out: + out_f32?, out) |
"""
from __future__ import annotations

from k3gen.library import gemm, kda, mla  # noqa: F401  (registers the ops)
from k3gen.library import attn, ffn, moe  # noqa: F401  (registers the ops)
from k3gen.library.table import handle_of, launcher, loaded, spec_of  # noqa: F401

OPS = ("act_quant_fp8", "act_quant_fp8_out", "fp8_block_gemm", "fp8_block_gemm_out", "kda_decode", "kda_decode_out",
       "kda_prefill", "kda_prefill_out", "kda_verify", "kda_verify_out", "kv_cache_write", "mla_decode",
       "mla_decode_out", "mla_q_absorb", "mla_q_absorb_out", "mla_vb_gate", "mla_vb_gate_out")
OPS += ("moe_route", "moe_route_out", "attn_res", "attn_res_out", "moe_experts", "moe_experts_out")
OPS += ("glu_act", "glu_act_out", "mla_prefill", "mla_prefill_out")
OPS += ("router_logits", "router_logits_out")
