import jax
import jax.numpy as jnp

from jspec import SpecConfig, attention_meta, kv, tree

cfg = SpecConfig(
    page_size=4,
    topk=2,
    num_steps=3,
    num_draft_tokens=4,
    context_len=64,
    max_running_requests=2,
    num_pages=32,
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
)
alloc, rows = kv.allocator_from_config(cfg), kv.init_req_to_token(cfg)
draft_pool = kv.init_kv_pool(cfg)
# Prefill one request (req_to_token row 1) with 7 tokens, then decode (SPEC.md §14).
row_ids, lens = jnp.array([1]), jnp.array([7])
alloc, slots, ok = kv.alloc_extend(alloc, jnp.array([0]), lens, jnp.array([-1]), max_new_slots=8)
rows = kv.assign_req_to_token_pool(rows, row_ids, jnp.array([0]), lens, slots)
prefix_kv = jax.random.normal(jax.random.PRNGKey(0), (cfg.num_layers, 7, 2, 8))  # draft KV
for layer in range(cfg.num_layers):
    draft_pool = kv.set_kv_buffer(draft_pool, layer, slots[:7], prefix_kv[layer], -prefix_kv[layer])
reqs = kv.ReqKVState(
    committed_lens=lens, allocated_lens=lens, req_pool_indices=row_ids, valid=jnp.array([True])
)
alloc, rows, reqs, ok = kv.prepare_for_decode(alloc, rows, reqs, cfg)  # row grows to 40
seq_lens = reqs.committed_lens
draft_pool, out_cache_loc, positions = tree.prepare_for_draft(  # holey layout + hole copies
    draft_pool, rows, reqs.req_pool_indices, seq_lens, geometry=cfg.geometry
)
seqlens, page_table = attention_meta.draft_decode_set_expand_metadata(  # FA3 expand, step 1
    seq_lens % 4, 2, out_cache_loc.reshape(-1, 3), geometry=cfg.geometry, impl="pallas"
)
print(ok, reqs.allocated_lens, out_cache_loc[0], seqlens, page_table)
