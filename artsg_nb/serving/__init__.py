"""Serving: the inference processes and everything about them: one server's lifecycle (server.py,
its config and its Python environment), the router and the fleet of N servers behind it, the
lifecycle both processes share (managed.py), process plumbing (procs.py), the GPU plan, and the engines' /metrics (prefix-cache hit rates).

The HTTP dialect of each engine lives in engines/, not here."""
