"""Which interpreter runs a sandbox's kernel, and what must be mounted for it.

- The template `python`: the server's own interpreter, on the host's /usr (its prefix
  bound at the same path when it lives elsewhere, a pyenv's say), with the server's sandbox
  runtime (numpy, pandas, ...) as its site-packages.
- A template whose image has python3 (>= 3.9): that interpreter, with the image's own
  packages (`site` runs), so what the image installed imports; `sys.executable` says so.
- A template without one: the server's interpreter again, bound read-only under
  /opt/cloche, started through the host's dynamic loader with the host's libraries, so it
  runs whatever C library the image has (or none).

The kernel itself is stdlib only and runs on all three.
"""

from __future__ import annotations

import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from cloche.sandbox.base import KERNEL_PACKAGE_DIR, kernel_command
from cloche.sandbox.bundle import DOOR_MOUNT, KERNEL_MOUNT, RUNTIME_MOUNT, SITE_MOUNT, Mount
from cloche.sandbox.layers import System

PACKAGE_PARENT = str(Path(KERNEL_MOUNT).parent.parent)  # holds cloche/kernel inside
FOREIGN_PYTHON = "/opt/cloche/python"  # the server's prefix, in an image without python3
FOREIGN_LIBS = "/opt/cloche/hostlib"  # the host's libraries it needs, beside it


@dataclass(frozen=True)
class Kernel:
    """How to start a kernel: its command line and the host directories it needs."""

    command: list[str]
    mounts: list[Mount]


class Interpreters:
    """The server's interpreter as each kind of system can run it."""

    def __init__(self, runtime_dir: Path | None) -> None:
        self.prefix = Path(sys.base_prefix).resolve()
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        self.python = str(Path(sys.base_exec_prefix) / "bin" / f"python{version}")
        self.runtime = runtime_dir.resolve() if runtime_dir and runtime_dir.is_dir() else None
        self.mounts = [Mount(KERNEL_PACKAGE_DIR, KERNEL_MOUNT)]
        if not self.prefix.is_relative_to("/usr"):
            self.mounts.append(Mount(self.prefix, str(self.prefix)))
        if self.runtime is not None:
            self.mounts.append(Mount(self.runtime, RUNTIME_MOUNT))

    def reserved_paths(self) -> list[str]:
        """Where sandboxes mount what they need (/usr, the kernel, the runtime, the
        interpreter's prefix, the door, the session's packages) and its images' pythons."""
        own = {m.destination for m in self.mounts}
        own |= {"/usr", PACKAGE_PARENT, RUNTIME_MOUNT, SITE_MOUNT, DOOR_MOUNT}
        return sorted(own | {FOREIGN_PYTHON, FOREIGN_LIBS})

    def for_system(self, system: System, runtime: Path | None = None) -> Kernel:
        """The kernel of a sandbox of system; runtime: a profile's own site-packages,
        instead of the server's (on the server's interpreter only)."""
        kernel_mount = Mount(KERNEL_PACKAGE_DIR, KERNEL_MOUNT)
        if system.python is not None:  # the image's own interpreter and packages
            command = kernel_command(system.python, PACKAGE_PARENT, [SITE_MOUNT])
            command.remove("-S")
            return Kernel(command, [kernel_mount])
        mounts = [m for m in self.mounts if m.destination != RUNTIME_MOUNT]
        if runtime is not None:
            mounts.append(Mount(runtime.resolve(), RUNTIME_MOUNT))
        elif self.runtime is not None:
            mounts.append(Mount(self.runtime, RUNTIME_MOUNT))
        sys_path = [RUNTIME_MOUNT, SITE_MOUNT] if runtime or self.runtime else [SITE_MOUNT]
        if system.usr is not None:  # the template python: the host's /usr is there
            return Kernel(kernel_command(self.python, PACKAGE_PARENT, sys_path), mounts)
        return self._foreign(mounts, sys_path)

    def _foreign(self, mounts: list[Mount], sys_path: list[str]) -> Kernel:
        """The server's interpreter in an image without python3, through the host's loader."""
        libs = Path(sysconfig.get_config_var("LIBDIR") or "/usr/lib")
        multiarch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
        host_libs = Path("/usr/lib") / multiarch
        loader = next(
            (p for p in host_libs.glob("ld-linux*.so*") if p.is_file()), host_libs / "ld.so"
        )
        inside = Path(FOREIGN_PYTHON) / Path(self.python).relative_to(self.prefix)
        # The interpreter's own libraries first, as its RUNPATH has them on the host: the
        # host's library directory may hold another build's libpython of the same X.Y
        # (Debian's, beside a pyenv's), whose symbols the extension modules don't match.
        library_path = [f"{FOREIGN_PYTHON}/lib"]
        if libs.is_relative_to(self.prefix) and libs != self.prefix / "lib":
            library_path.append(str(Path(FOREIGN_PYTHON) / libs.relative_to(self.prefix)))
        library_path.append(FOREIGN_LIBS)
        mounts = [m for m in mounts if m.destination != str(self.prefix)]
        mounts += [Mount(self.prefix, FOREIGN_PYTHON), Mount(host_libs, FOREIGN_LIBS)]
        loader_inside = f"{FOREIGN_LIBS}/{loader.name}"
        command = kernel_command(str(inside), PACKAGE_PARENT, sys_path)
        command = [
            loader_inside,
            "--library-path",
            ":".join(library_path),
            "--argv0",
            str(inside),
            *command,
        ]
        return Kernel(command, mounts)
