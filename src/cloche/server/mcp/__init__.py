"""The MCP front end: cloche's tools (tools.py), over stdio (stdio.py) or at /mcp (http.py)."""
