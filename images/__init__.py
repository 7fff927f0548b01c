"""The container images: `make images` builds them (build.py), `make test-images` runs them (tests/)."""
