"""Host-memory and disk KV tiers under the radix tree (HiCache); a library that never imports
radixlm.srt or radixlm.radix.

- ``host_pool``: the host KV pool (pinned on GPU machines), one page layout for all layers;
- ``copy_engine``: device <-> host copies (synchronous on CPUs; CUDA streams and per-layer
  events on GPUs); ``controller``: what the tree calls, with measured copy bandwidths;
- ``page_hash``: chained page keys and the model fingerprint; ``storage_base``: the page-store
  contract; ``disk_store``: one verified file per page; ``storage_io``: background disk I/O with
  bounded queues.
"""

from __future__ import annotations
