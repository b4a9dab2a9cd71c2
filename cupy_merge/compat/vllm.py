"""vLLM's ``merge_attn_states``, where the other peers' drop-ins are: it is :func:`cupy_merge.merge_attn_states` itself.

vLLM's layout is the core's (LSE ``[num_heads, num_tokens]``, natural log) and its signature,
``merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
output_lse=None, prefill_tokens_with_context=None, output_scale=None, output_block_scale=None,
quant_group_size=None, quant_scale_ue8m0=False)``, is the core merge's, so nothing is adapted:
this module only names it beside FlashInfer's, SGLang's, FlashAttention's and xFormers'.

>>> from cupy_merge.compat import vllm
>>> import cupy_merge
>>> vllm.merge_attn_states is cupy_merge.merge_attn_states
True
"""

from __future__ import annotations

from ..merge import merge_attn_states

__all__ = ["merge_attn_states"]
