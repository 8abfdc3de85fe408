"""Paths in a session's working directory, as clients give them: what is accepted, in one
place, so that a front end can refuse a bad path before it takes a sandbox."""

from __future__ import annotations

from cloche.errors import PathRefused

MAX_PATH_BYTES = 4096  # PATH_MAX
MAX_NAME_BYTES = 255  # NAME_MAX


def normalise(relative: str) -> str:
    """Check a client's relative path and put it in canonical form.

    ``"./a//b/"`` becomes ``"a/b"``. Nothing that could leave the working directory
    gets through, but the result is only safe to use with this module's confined
    walk, which also refuses symlinks.

    Args:
        relative: A POSIX path relative to the working directory.

    Returns:
        The components joined by single slashes, without ``.`` or empty ones.

    Raises:
        PathRefused: The path is empty, absolute, has a ``..`` component or a NUL
            byte, isn't valid UTF-8, or is longer than PATH_MAX (4096 bytes) or has
            a component longer than NAME_MAX (255 bytes).
    """
    if not relative:
        raise PathRefused(relative, "it is empty")
    if "\0" in relative:
        raise PathRefused(relative, "it contains a NUL byte")
    if relative.startswith("/"):
        raise PathRefused(relative, "it is absolute; give a path relative to the working directory")
    try:
        encoded = relative.encode("utf-8")
    except UnicodeEncodeError:
        raise PathRefused(relative, "it is not valid UTF-8") from None
    if len(encoded) > MAX_PATH_BYTES:
        raise PathRefused(relative, f"it is longer than {MAX_PATH_BYTES} bytes")
    parts = [part for part in relative.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise PathRefused(relative, "it has a '..' component")
    if not parts:
        raise PathRefused(relative, "it names the working directory itself, not a file")
    for part in parts:
        if len(part.encode("utf-8")) > MAX_NAME_BYTES:
            raise PathRefused(relative, f"a component is longer than {MAX_NAME_BYTES} bytes")
    return "/".join(parts)
