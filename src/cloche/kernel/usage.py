"""The error of IPython syntax used wrongly: UsageError, as IPython names it."""


class UsageError(Exception):
    """A line of IPython syntax the kernel does not offer (an unknown magic), or a magic
    given arguments it does not take. The message names what is available."""


UsageError.__module__ = "builtins"  # shown as `UsageError: ...`, as IPython shows it
