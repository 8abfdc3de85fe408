"""Clients of a cloche server. The public API is re-exported by `cloche`.

aio.py (AsyncClient, AsyncSession: the HTTP API, written once), sync.py (Client, Session,
run: a blocking facade over it), execution.py (what a cell produced), tool.py (the
run_python tool for language models), tcp.py (a small client of the original REPL TCP
protocol); _errors.py and _sse.py are the wire's details.
"""
