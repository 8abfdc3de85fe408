"""matplotlib's font list for the sandboxes, built once with the runtime.

matplotlib keeps the fonts it knows in `<MPLCONFIGDIR>/fontlist-v<version>.json`. Without
it, the first `import matplotlib.pyplot` of a process lists and opens every font (fc-list,
then each file): about a second in a sandbox, many under load, and every session starts
with an empty MPLCONFIGDIR (in its own /tmp). So the list is built here, once, as a
sandbox would find it, into `<runtime>/.cloche/matplotlib/`; the kernel links it into its
MPLCONFIGDIR at start (`cloche.kernel.fonts`), where sandboxes read it through the
runtime's read-only mount.

Built as a sandbox sees fonts: fontconfig with the sandbox's own config (`/usr/share/fonts`
only), an empty HOME, and only fonts under /usr (bound into every sandbox) or matplotlib's
own (stored relative to its data directory, so valid under the runtime's mount), by the
interpreter the sandboxes run. The runtime's matplotlib runs here, on the host, as the
install of the runtime (pip) runs its packages' code: never use this on a runtime built
from wheels nobody vetted (a profile's, `cloche.packages.profiles`). Run it again when
fonts are added or removed (`scripts/install.sh` does when a font directory is newer than
the list).

    python -m cloche.sandbox.fonts RUNTIME_DIR
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SHIPPED = Path(".cloche") / "matplotlib"  # under a runtime's site-packages
BUILD_TIMEOUT_S = 600.0
FONTS_CONF = (  # as the sandbox's own /etc/fonts/fonts.conf, with a cache dir of the build's
    '<?xml version="1.0"?>\n<!DOCTYPE fontconfig SYSTEM "urn:fontconfig:fonts.dtd">\n'
    "<fontconfig><dir>/usr/share/fonts</dir><cachedir>{cache}</cachedir></fontconfig>\n"
)
# Run by the runtime's matplotlib: build the list, keep what a sandbox can open, write it.
_BUILD = """
import os, sys
sys.path.insert(0, sys.argv[1])
import matplotlib
from matplotlib import font_manager
data = os.path.join(matplotlib.get_data_path(), "")
manager = font_manager.fontManager
for name in ("ttflist", "afmlist"):
    fonts = getattr(manager, name)
    setattr(manager, name, [f for f in fonts if f.fname.startswith(("/usr/", data))])
out = os.path.join(sys.argv[2], f"fontlist-v{font_manager.FontManager.__version__}.json")
font_manager.json_dump(manager, out)
print(out)
"""


def shipped_dir(runtime_dir: Path) -> Path:
    """Where a runtime's font list goes."""
    return runtime_dir / SHIPPED


def sandbox_python() -> str:
    """The interpreter sandboxes run (as `GVisorBackend` starts them)."""
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    return str(Path(sys.base_exec_prefix) / "bin" / version)


def build(runtime_dir: Path, python: str | None = None) -> Path | None:
    """Build the font list of the runtime's matplotlib into `shipped_dir(runtime_dir)`, in
    place of any earlier one; its path (None: the runtime has no matplotlib).

    Raises:
        subprocess.CalledProcessError: matplotlib failed to build it (its stderr is in it).
    """
    if not (runtime_dir / "matplotlib").is_dir():
        return None
    with tempfile.TemporaryDirectory(prefix="cloche-fonts-") as scratch:
        root = Path(scratch)
        home, mpl, out, fc_cache = (root / n for n in ("home", "mpl", "out", "fontconfig"))
        for directory in (home, mpl, out, fc_cache):
            directory.mkdir()
        conf = root / "fonts.conf"
        conf.write_text(FONTS_CONF.format(cache=fc_cache))
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(home),
            "LANG": "C.UTF-8",
            "MPLBACKEND": "Agg",
            "MPLCONFIGDIR": str(mpl),
            "FONTCONFIG_FILE": str(conf),
        }
        command = [
            python or sandbox_python(),
            "-I",
            "-S",
            "-B",
            "-c",
            _BUILD,
            str(runtime_dir.resolve()),
            str(out),
        ]
        done = subprocess.run(  # noqa: S603  # our own script, on the runtime given
            command,
            env=env,
            cwd=home,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=True,
        )
        built = Path(done.stdout.strip().splitlines()[-1])
        target = shipped_dir(runtime_dir)
        staging = target.with_name(f".{target.name}.new")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        shutil.copyfile(built, staging / built.name)
        for path in (staging, staging.parent, staging / built.name):
            path.chmod(0o755 if path.is_dir() else 0o644)  # read by the sandbox's user
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        return target / built.name


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m cloche.sandbox.fonts RUNTIME_DIR")
    try:
        built = build(Path(sys.argv[1]))
    except subprocess.CalledProcessError as exc:
        sys.exit(f"matplotlib's font list was not built:\n{exc.stderr}")
    print(built if built is not None else "no matplotlib in the runtime: no font list")


if __name__ == "__main__":
    main()
