"""Guardrails on what goes into and comes out of the model: checkers behind one interface, a policy that
says which run and what their findings do, and the server's use of them (kvfleet.runtime.server)."""
