"""Clients of a cloche server. The public API is re-exported by `cloche`.

aio.py (AsyncClient and AsyncSession: the HTTP API, written once), verbs.py (what a
session does: its cells, files, context, copies, packages, history), commands.py (its
commands: `session.commands`), process.py (a process of it, and how a command ended),
terminal.py (its terminals: `session.pty()`), info.py (what the server tells of
sessions, snapshots, files), sync.py and sync_processes.py (Client, Session, Commands,
Process, Terminal, run: blocking facades over them, on _loop.py's thread), execution.py
(what a cell produced), tool.py (the run_python tool for language models), tcp.py (a
small client of the original REPL TCP protocol); _wire.py (what the verbs need of the
client), _errors.py, _files.py and _sse.py are the wire's details.
"""
