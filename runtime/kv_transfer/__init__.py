"""KV connectors: what moves a request's KV blocks from the paged cache of one engine into another's, so that
a prefill replica computes a prompt and a decode replica generates from its blocks (disaggregated prefill and
decode). A connector has a scheduler-side half, which decides which blocks a request loads or keeps for a
peer, and a worker-side half, which moves them; the bytes travel over a block transport kept behind it, so
that another transport (a GPU one) can take its place.
"""
