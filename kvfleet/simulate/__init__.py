"""The fleet simulator (`kvfleet simulate`): a discrete-event model of a fleet of replicas, routed by the
gateway's own policies and scaled by the operator's own autoscaler, replaying a trace of requests."""
