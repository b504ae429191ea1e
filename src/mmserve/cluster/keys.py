"""A processed prompt's routing keys: its media content keys and its prefix-block hashes.

Role: compute, in the API server before dispatch, the same block hashes a replica's KV cache
manager will compute for the prompt (token ids, the media overlapping each block, the cache salt)
and the content key and embedding rows of each item, as `RouteKeys`.
What it does not know: replicas, scoring, tensors (the items' payloads are never read).
"""

from __future__ import annotations

from mmserve.cluster.router import RouteKeys
from mmserve.core.kv_cache import block_extra_keys, hash_block, salted_root
from mmserve.core.request import item_specs
from mmserve.inputs.items import ProcessedPrompt


def route_keys(prompt: ProcessedPrompt, block_size: int) -> RouteKeys:
    items = item_specs(prompt.items)
    tokens = prompt.prompt_token_ids
    hashes: list[bytes] = []
    parent = salted_root(prompt.cache_salt)
    for start in range(0, len(tokens) - len(tokens) % block_size, block_size):
        parent = hash_block(parent, tokens[start:start + block_size],
                            block_extra_keys(items, start, start + block_size))
        hashes.append(parent)
    return RouteKeys(tuple((it.content_hash, it.output_rows) for it in items), tuple(hashes), block_size, len(tokens))
