"""Clients of a cloche server. The public API is re-exported by `cloche`.

aio.py (AsyncClient and AsyncSession: the HTTP API, written once), verbs.py (what a
session does: its cells, files, context, copies, packages, history), info.py (what the
server tells of sessions, snapshots, files), sync.py (Client, Session, run: a blocking
facade over them), execution.py (what a cell produced), tool.py (the run_python tool for
language models), tcp.py (a small client of the original REPL TCP protocol); _wire.py
(what the verbs need of the client), _errors.py, _files.py and _sse.py are the wire's
details.
"""
