"""The magics a cell can use: a documented subset of IPython's, printing what IPython prints.

Line magics: %cd, %env, %history, %load, %matplotlib, %pinfo, %pinfo2, %pip, %pwd, %reset,
%run, %time, %timeit, %who, %whos. Cell magics: %%bash, %%sh, %%time, %%timeit,
%%writefile. Any other name raises UsageError, naming these.

Where IPython would need a front end the kernel doesn't have, a magic does what a script
would: `%load path` runs the file's code in the session (IPython puts it in the next cell
for the user to run), `%reset` without `-f` refuses (it can't ask), `%cd` to a missing
directory raises (IPython prints the error and goes on).
"""

from __future__ import annotations

import builtins
import linecache
import os
import shlex
import shutil
import subprocess
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .expansion import expand
from .inspection import object_help
from .ipython import compile_cell, translate
from .processes import SH, run_command
from .timing import TimeitResult, time_run, timeit_options, timeit_run
from .usage import UsageError

if TYPE_CHECKING:
    from .shell import Shell

_KERNEL_PACKAGE = __name__.rpartition(".")[0]
_SECRET_WORDS = ("key", "token", "secret")  # `%env` hides such variables' values, as IPython
_NOTHING_TO_LIST = "No variables match your requested type."
_EMPTY_NAMESPACE = "Interactive namespace is empty."


@dataclass(frozen=True)
class Place:
    """Where a magic was written: code it runs is compiled as standing there."""

    filename: str
    line: int  # the line its code starts on
    text: str  # the line as written, to find the code's column in (`%time x`)
    locals: dict[str, Any] | None  # of the function it was called in

    def column(self, code: str) -> int:
        """The code's column in the line, in UTF-8 bytes as the compiler counts."""
        found = self.text.find(code) if code else -1
        return len(self.text[:found].encode()) if found > 0 else 0


LineMagic = Callable[[str, Place], Any]
CellMagic = Callable[[str, str, Place], Any]


class Magics:
    """The session's magics; the shell runs them."""

    def __init__(self, shell: Shell) -> None:
        self.shell = shell
        self._previous_dir: str | None = None
        self.line: dict[str, LineMagic] = {
            "cd": self.cd,
            "env": self.env,
            "history": self.history,
            "load": self.load,
            "matplotlib": self.matplotlib,
            "pinfo": self.pinfo,
            "pinfo2": self.pinfo2,
            "pip": self.pip,
            "pwd": self.pwd,
            "reset": self.reset,
            "run": self.run,
            "time": self.time,
            "timeit": self.timeit,
            "who": self.who,
            "whos": self.whos,
        }
        self.cell: dict[str, CellMagic] = {
            "bash": self.bash,
            "sh": self.sh,
            "time": self.time_cell,
            "timeit": self.timeit_cell,
            "writefile": self.writefile,
        }
        # Magics whose line holds Python code or a pip command: no `{expr}`/`$name` expansion.
        self._verbatim = {"pinfo", "pinfo2", "pip", "time", "timeit"}

    # -- dispatch ---------------------------------------------------------------------------

    def place(self, depth: int, text: str | None) -> Place:
        """The Place of a magic called `depth` frames above the caller: on its caller's
        line (`text` the magic's line), on the next (a cell magic: `text` ""), or
        nowhere in particular (`text` None: called through get_ipython())."""
        frame = sys._getframe(depth + 1)
        local_ns = frame.f_locals if frame.f_locals is not frame.f_globals else None
        if text is None:
            return Place("<magic>", 1, "", local_ns)
        filename = frame.f_code.co_filename
        if text == "":
            return Place(filename, frame.f_lineno + 1, "", local_ns)
        written = linecache.getline(filename, frame.f_lineno).rstrip("\n")
        return Place(filename, frame.f_lineno, written, local_ns)

    def run_line(self, name: str, line: str, place: Place) -> Any:
        magic = self.line.get(name)
        if magic is None:
            hint = f" (But cell magic `%%{name}` exists, did you mean that instead?)"
            raise UsageError(
                f"Line magic function `%{name}` not found."
                + (hint if name in self.cell else "")
                + " "
                + self._available()
            )
        if name not in self._verbatim:
            line = expand(line, self._namespace(place))
        return magic(line, place)

    def run_cell(self, name: str, line: str, cell: str, place: Place) -> Any:
        magic = self.cell.get(name)
        if magic is None:
            hint = f" (But line magic `%{name}` exists, did you mean that instead?)"
            raise UsageError(
                f"Cell magic `%%{name}` not found."
                + (hint if name in self.line else "")
                + " "
                + self._available()
            )
        if name not in self._verbatim:
            line = expand(line, self._namespace(place))
        return magic(line, cell, place)

    def _available(self) -> str:
        line = ", ".join(f"%{name}" for name in sorted(self.line) if not name.startswith("pinfo"))
        cell = ", ".join(f"%%{name}" for name in sorted(self.cell))
        return (
            f"Available in this kernel: line magics {line}; cell magics {cell}; "
            "shell commands !cmd, x = !cmd; help obj? and obj??."
        )

    def _namespace(self, place: Place) -> dict[str, Any]:
        if place.locals is None:
            return self.shell.user_ns
        return {**self.shell.user_ns, **place.locals}

    def _run_code(self, code: str, place: Place) -> Any:
        """Run Python (IPython syntax allowed) where it was written; the value of its last
        expression, if it ends on one."""
        compiled = compile_cell(
            code, place.filename, first_line=place.line, column=place.column(code)
        )
        namespace = self.shell.user_ns
        exec(compiled.body, namespace, place.locals)  # noqa: S102  # the user's code
        if compiled.tail is None:
            return None
        return eval(compiled.tail, namespace, place.locals)  # noqa: S307  # the user's code

    # -- the file system and the environment ------------------------------------------------

    def cd(self, line: str, place: Place) -> None:
        """Change the working directory: `%cd path`, `%cd` (home), `%cd -` (the previous
        one), `-q` not to print the new one."""
        argument = line.strip()
        quiet = argument == "-q" or argument.startswith("-q ")
        if quiet:
            argument = argument[2:].strip()
        if argument == "-":
            if self._previous_dir is None:
                raise UsageError("%cd -: there is no previous directory")
            target = self._previous_dir
        elif not argument:
            target = os.path.expanduser("~")
        else:
            target = os.path.expanduser(_unquote(argument))
        previous = os.getcwd()
        os.chdir(target)
        self._previous_dir = previous
        if not quiet:
            print(os.getcwd())

    def pwd(self, line: str, place: Place) -> str:
        """The working directory."""
        return os.getcwd()

    def env(self, line: str, place: Place) -> Any:
        """`%env` (all, secrets hidden), `%env NAME`, `%env NAME=value`, `%env NAME value`."""
        if not line.strip():
            return {
                key: "<hidden>" if any(word in key.lower() for word in _SECRET_WORDS) else value
                for key, value in os.environ.items()
            }
        separator = "=" if "=" in line else " "
        parts = line.split(separator, 1)
        if len(parts) == 1 or (separator == " " and not parts[1].strip()):
            key = line.strip()
            if key not in os.environ:
                raise UsageError(f"Environment does not have key: {key}")
            return os.environ[key]
        name, value = parts[0].strip(), parts[1].strip()
        if not name or any(char.isspace() for char in name):
            raise UsageError(f"refusing to set env var with whitespace: '{value}'")
        os.environ[name] = value
        print(f"env: {name}={value}")
        return None

    def writefile(self, line: str, cell: str, place: Place) -> None:
        """`%%writefile [-a] path`: write (or append) the cell's body to a file."""
        words = _split(line, "%%writefile")
        append = any(word in ("-a", "--append") for word in words)
        names = [word for word in words if word not in ("-a", "--append")]
        if len(names) != 1 or names[0].startswith("-"):
            raise UsageError("usage: %%writefile [-a] filename")
        path = os.path.expanduser(names[0])
        if os.path.exists(path):
            print(f"Appending to {path}" if append else f"Overwriting {path}")
        else:
            print(f"Writing {path}")
        with open(path, "a" if append else "w", encoding="utf-8") as file:
            file.write(cell)

    # -- shell ------------------------------------------------------------------------------

    def bash(self, line: str, cell: str, place: Place) -> None:
        """Run the cell with bash (or /bin/sh when the sandbox has no bash)."""
        self._script("bash", shutil.which("bash") or SH, line, cell)

    def sh(self, line: str, cell: str, place: Place) -> None:
        """Run the cell with /bin/sh."""
        self._script("sh", SH, line, cell)

    def _script(self, name: str, program: str, line: str, cell: str) -> None:
        raise_error = True
        for word in _split(line, f"%%{name}"):
            if word != "--no-raise-error":
                raise UsageError(f"%%{name} takes only --no-raise-error here, not {word}")
            raise_error = False
        code, _ = run_command([program, "-c", cell], capture=False)
        if raise_error and code != 0:
            raise subprocess.CalledProcessError(code, cell)

    # -- timing -----------------------------------------------------------------------------

    def time(self, line: str, place: Place) -> Any:
        """Time one run of a statement or expression: CPU times, then wall time."""
        raise_error = True
        if line.lstrip().startswith("--no-raise-error"):
            line = line.lstrip()[len("--no-raise-error") :].strip()
            raise_error = False
        return time_run(lambda: self._run_code(line, place), raise_error=raise_error)

    def time_cell(self, line: str, cell: str, place: Place) -> Any:
        """Time one run of the cell."""
        raise_error = True
        if line.strip() == "--no-raise-error":
            raise_error = False
        elif line.strip():
            raise UsageError("Can't use statement directly after '%%time'!")
        return time_run(lambda: self._run_code(cell, place), raise_error=raise_error)

    def timeit(self, line: str, place: Place) -> TimeitResult | None:
        """Time a statement over many loops: `%timeit [-n N] [-r R] [-p P] [-q] [-o] stmt`."""
        options, statement = timeit_options(line)
        if not statement.strip():
            return None
        return timeit_run(options, statement, "pass", self._namespace(place))

    def timeit_cell(self, line: str, cell: str, place: Place) -> TimeitResult | None:
        """Time the cell over many loops; the line (after options) is its setup, untimed."""
        options, setup = timeit_options(line)
        return timeit_run(options, cell, setup or "pass", self._namespace(place))

    # -- the namespace and the session ------------------------------------------------------

    def who(self, line: str, place: Place) -> None:
        """The session's variables, or those of the types named: `%who int str`."""
        names = self._variables(line)
        if not names:
            print(_NOTHING_TO_LIST if line.strip() else _EMPTY_NAMESPACE)
            return
        row = 0
        for name in names:
            print(name + "\t", end=" ")
            row += 1
            if row > 8:
                row = 0
                print()
        print()

    def whos(self, line: str, place: Place) -> None:
        """The session's variables with their types and values, as a table."""
        names = self._variables(line)
        if not names:
            print(_NOTHING_TO_LIST if line.strip() else _EMPTY_NAMESPACE)
            return
        values = [self.shell.user_ns[name] for name in names]
        types_ = [type(value).__name__ for value in values]
        name_width = max(*map(len, names), len("Variable")) + 3
        type_width = max(*map(len, types_), len("Type")) + 3
        print(
            "Variable".ljust(name_width)
            + "Type".ljust(type_width)
            + " Data/Info\n"
            + "-" * (name_width + type_width + len("Data/Info") + 1)
        )
        for name, value, type_name in zip(names, values, types_, strict=True):
            print(f"{name:<{name_width}}{type_name:<{type_width}}", end=" ")
            if type_name in ("dict", "list", "tuple"):
                print(f"n={len(value)}")
                continue
            try:
                text = str(value)
            except Exception:
                text = f"<object with id {id(value)} (str() failed)>"
            text = text.replace("\n", "\\n")
            print(text if len(text) < 50 else text[:25] + "<...>" + text[-25:])

    def _variables(self, line: str) -> list[str]:
        wanted = set(line.split())
        names = [
            name
            for name, value in self.shell.user_ns.items()
            if not name.startswith("_") and not _is_kernels(value)
        ]
        if wanted:
            names = [n for n in names if type(self.shell.user_ns[n]).__name__ in wanted]
        return sorted(names)

    def reset(self, line: str, place: Place) -> None:
        """`%reset -f`: delete the session's variables (imports and definitions too)."""
        words = line.split()
        if not words or any(word not in ("-f", "-s") for word in words) or "-f" not in words:
            raise UsageError(
                "%reset asks for confirmation, which this kernel can't take: use %reset -f "
                "(only -f and -s are available)"
            )
        namespace = self.shell.user_ns
        for name in list(namespace):
            if not (name.startswith("__") and name.endswith("__")) and not _is_kernels(
                namespace[name]
            ):
                del namespace[name]
        self.shell.install(namespace)

    def history(self, line: str, place: Place) -> None:
        """The session's cells: `%history [-n] [N | N-M ...]` (-n: with their numbers)."""
        numbered = False
        wanted: list[range] = []
        for word in line.split():
            if word == "-n":
                numbered = True
                continue
            first, _, last = word.partition("-")
            if not first.isdigit() or (last and not last.isdigit()):
                raise UsageError("usage: %history [-n] [N | N-M ...]")
            wanted.append(range(int(first), int(last or first) + 1))
        for number, source in self.shell.history.cells():
            if wanted and not any(number in span for span in wanted):
                continue
            text = source.expandtabs(4).rstrip()
            if numbered:
                separator = "\n" if "\n" in text else " "
                print(f"{str(number).rjust(4)}:{separator}", end="")
            print(text)

    def load(self, line: str, place: Place) -> Any:
        """`%load path`: run the file's code in the session, as its next cell would."""
        words = _split(line, "%load")
        if len(words) != 1 or words[0].startswith("-"):
            raise UsageError("usage: %load path (options and URLs are not available here)")
        path = os.path.abspath(os.path.expanduser(words[0]))
        with open(path, encoding="utf-8") as file:
            source = file.read()
        return self._run_code(source, Place(path, 1, "", place.locals))

    def run(self, line: str, place: Place) -> None:
        """`%run [-i] script.py [args...]`: run a script as `__main__` (with `-i`, in the
        session's namespace); what it defines is then the session's."""
        words = _split(line, "%run")
        interactive = bool(words) and words[0] == "-i"
        if interactive:
            words = words[1:]
        if not words or words[0].startswith("-"):
            raise UsageError("usage: %run [-i] script.py [args...]")
        path = os.path.expanduser(words[0])
        if not os.path.exists(path) and os.path.exists(path + ".py"):
            path += ".py"
        if not os.path.isfile(path):
            raise UsageError(f"File `{path!r}` not found.")
        path = os.path.abspath(path)
        with open(path, encoding="utf-8") as file:
            source = file.read()
        code = compile(
            translate(source) if path.endswith(".ipy") else source,
            path,
            "exec",
            dont_inherit=True,
        )
        user_ns = self.shell.user_ns
        namespace: dict[str, Any] = user_ns
        if not interactive:
            namespace = {"__name__": "__main__", "__file__": path, "__builtins__": builtins}
            self.shell.install(namespace)
        argv = sys.argv
        sys.argv = [path, *words[1:]]
        try:
            exec(code, namespace)  # noqa: S102  # the user's script
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
        finally:
            sys.argv = argv
            if namespace is not user_ns:
                user_ns.update(
                    (name, value)
                    for name, value in namespace.items()
                    if not (name.startswith("__") and name.endswith("__"))
                )

    def matplotlib(self, line: str, place: Place) -> None:
        """`%matplotlib inline`: accepted; figures are shown as PNG images anyway."""
        if line.strip() not in ("", "inline"):
            raise UsageError(
                f"%matplotlib {line.strip()} is not available: figures are shown as PNG "
                "images (as with %matplotlib inline)"
            )

    def pip(self, line: str, place: Place) -> Any:
        """`%pip install PACKAGE...`: the server installs packages for the session."""
        install = getattr(builtins, "__cloche_pip__", None)
        if install is None:
            raise UsageError("%pip is not available in this kernel")
        return install(line)

    # -- help -------------------------------------------------------------------------------

    def pinfo(self, line: str, place: Place) -> None:
        """`obj?`: the object's signature and docstring."""
        self._page(self.help_text(line.strip(), 0, self._namespace(place)))

    def pinfo2(self, line: str, place: Place) -> None:
        """`obj??`: the object's signature and source (or docstring)."""
        self._page(self.help_text(line.strip(), 1, self._namespace(place)))

    def _page(self, text: str) -> None:
        pager = self.shell.pager
        if pager is not None:
            pager(text)
        else:
            print(text)

    def help_text(self, target: str, detail_level: int, namespace: dict[str, Any]) -> str:
        """What `target?` shows: an object's info, a magic's docstring, or an overview."""
        if not target:
            return self._available()
        if target.startswith("%"):
            name = target.lstrip("%")
            magic: Any = (self.cell if target.startswith("%%") else self.line).get(name)
            if magic is None:
                magic = self.line.get(name) or self.cell.get(name)
            if magic is None:
                return f"Object `{target}` not found."
            return f"Docstring: {magic.__doc__}\nType:      Magic function"
        return object_help(target, namespace, detail_level)


def _split(line: str, magic: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"{magic}: can't read the arguments: {exc}") from None


def _unquote(text: str) -> str:
    try:
        words = shlex.split(text)
    except ValueError:
        return text
    return words[0] if len(words) == 1 else text


def _is_kernels(value: Any) -> bool:
    """Whether a value is one the kernel put in the namespace (get_ipython, llm_query)."""
    if not isinstance(value, types.FunctionType | types.MethodType | type):
        return False
    return str(getattr(value, "__module__", "")).startswith(_KERNEL_PACKAGE + ".")
