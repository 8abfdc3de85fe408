"""The kernel: runs inside the sandbox, on the sandbox's interpreter, stdlib only.

Nothing here imports from the rest of cloche: the sandbox sees only this directory.
"""
