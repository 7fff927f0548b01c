"""kvfleet on the local cluster: the chart, InferenceServices, traffic and what to watch, for the end-to-end
tests, the demo and the fleet benchmark."""
