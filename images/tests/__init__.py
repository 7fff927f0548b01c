"""`make test-images`: the built images run as the chart's and the operator's pods run them."""
