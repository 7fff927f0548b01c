"""What the runtime, the operator and the gateway must agree on, written once.

Imported as `kvfleet.contract`. Each module holds one part of the agreement: SLA tiers and their engine
priorities, the engine's choices the operator renders (scheduling policies, dtypes), the gateway's routing
policies, the roles and transfer keys of disaggregated prefill and decode, the metric names a replica exports
and its readers scrape, the safety policy's levels and actions, who goes first between two requests, the
fields of a score's two sides, and the rule by which a prompt's KV blocks are hashed. It imports no other part
of kvfleet and nothing beyond the standard library, so every process can load it.
"""
