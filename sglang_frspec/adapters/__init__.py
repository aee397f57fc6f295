"""Thin adapters, one module per SGLang seam: args (argument resolution), head (the target's
vocab-parallel LM head), logits (the draft logits processor), worker (EagleDraftWorker
start-up and weight refreshes), token_map (map sources SGLang accepts), coverage (committed
tokens in the map, while serving), adapt (the map following the traffic), pd (hot indices
between prefill and decode nodes). hooks.py holds the one table of the hooks they install;
contract.py lists every SGLang name they rely on."""
