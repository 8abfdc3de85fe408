"""Front ends over one session manager: the REPL TCP protocol and HTTP."""
