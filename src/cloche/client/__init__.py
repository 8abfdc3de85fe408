"""Clients of a cloche server."""
