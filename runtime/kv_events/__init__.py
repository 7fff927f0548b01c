"""KV-cache events: what a replica's prefix cache holds, published in vLLM's format
(kvfleet.contract.kv_events) so that a router can send each prompt where its prefix is cached.

The block pool and the host tier report to a collector as they go; once per step the engine core hands the
step's events to a publisher, whose thread sends them on a ZeroMQ PUB socket and answers replay requests, so
that a step never waits on a subscriber.
"""
