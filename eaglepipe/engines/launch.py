"""A server the pipeline starts and always stops (``infer.<engine>.launch``, the serve check), its arguments completed
by ``servers``. The ``launch`` params (config.Launch):

    launch:
      model_path: /models/Kimi-K2.5   # the model served; default the target's folder
      tp: 8                           # tensor-parallel size
      dp: 1                           # data-parallel replicas
      host: 127.0.0.1                 # --host
      port: 30000                     # --port; the client talks to http://host:port
      extra_args: [--mem-fraction-static, "0.9"]   # a list, or one string split like a shell
      command: null                   # what to run instead of the engine's launcher
      log: null                       # the server's output; default .cache/<engine>/server-<port>.log
      stop_timeout_s: 60              # SIGTERM, then SIGKILL after this long

The server runs in its own process group and is stopped as a group; on Linux it also gets SIGTERM when the stage
dies (kill -9), and while it runs a SIGTERM to the stage (in its main thread, with no handler of its own) becomes a
SystemExit, so the stage stops it on the way out. Before it starts, ``installed`` reads the engine's version from the
package metadata of the Python that runs the launcher: a launched server's identity is its arguments and that version
(the engines' ``predicted``), checked against what the server reports once it runs.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

from eaglepipe.core.config import CACHE
from eaglepipe.target import remote

ROOT = Path(__file__).resolve().parents[2]
"""The project's folder (the launcher's default environments live there)."""
PYTHON = re.compile(r"python[0-9.]*")  # the file name of a Python interpreter
# The version of the distribution that installs module argv[1], from its package metadata (nothing imported).
VERSION_OF = (
    "import importlib.metadata as m, sys; "
    "print(m.version((m.packages_distributions().get(sys.argv[1]) or [sys.argv[1]])[0]))"
)


def _die_with_parent():  # pragma: no cover - runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def flag_value(args: list[str], flag: str) -> str | None:
    """The value ``args`` give ``flag`` (``--flag v`` or ``--flag=v``; the last one wins, as in argparse), or None."""
    values = [
        args[i + 1] if a == flag else a.split("=", 1)[1]
        for i, a in enumerate(args)
        if (a == flag and i + 1 < len(args)) or a.startswith(flag + "=")
    ]
    return values[-1] if values else None


class LaunchedServer:
    def __init__(self, cfg, engine: str, launcher: list[str], model_args: list[str], env: dict | None = None):
        """``cfg``: the ``launch`` params (config.Launch); ``launcher``: the engine's default command; ``model_args``:
        its arguments naming the model and the parallelism; ``env``: variables added to the server's environment."""
        self.engine, self.host, self.port = engine, cfg.host, cfg.port
        extra = cfg.extra_args
        self.extra_args = shlex.split(extra) if isinstance(extra, str) else list(extra)
        command = cfg.command or launcher
        self.command = shlex.split(command) if isinstance(command, str) else list(command)
        self.model_args, self.env = list(model_args), dict(env or {})
        self.log_path = Path(cfg.log) if cfg.log else CACHE / engine / f"server-{self.port}.log"
        self.stop_timeout_s = cfg.stop_timeout_s
        self.proc: subprocess.Popen | None = None
        self._versions: dict[str, str | None] = {}
        self._old_sigterm = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def interpreter(self) -> str | None:
        """The Python that runs the launcher (its command's first word, when that is a Python), or None."""
        return self.command[0] if PYTHON.fullmatch(Path(self.command[0]).name) else None

    def argv(self) -> list[str]:
        return [*self.command, *self.model_args, "--host", self.host, "--port", str(self.port), *self.extra_args]

    def flag(self, name: str) -> str | None:
        """The value the server's arguments give flag ``name``, or None."""
        return flag_value(self.argv()[len(self.command) :], name)

    def describe(self) -> dict:
        """What engine.json keeps: the arguments (not the launcher), the added environment (paths in the project
        relative to it, the same in every clone) and the log."""
        env = {k: v.replace(f"{ROOT}{os.sep}", "") for k, v in self.env.items()}
        return {"argv": self.argv()[len(self.command) :], "env": env, "log": str(self.log_path)}

    def installed(self, module: str) -> str | None:
        """The version of the distribution that installs ``module`` where the launcher runs, read from its package
        metadata without starting anything (once); None when the launcher is no Python or that Python lacks it."""
        if module not in self._versions:
            self._versions[module] = self._read_version(module)
        return self._versions[module]

    def _read_version(self, module: str) -> str | None:
        if self.interpreter is None:
            return None
        try:
            out = subprocess.run(
                [self.interpreter, "-c", VERSION_OF, module],
                capture_output=True,
                text=True,
                env={**os.environ, **self.env},
                timeout=120,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        version = out.stdout.strip()
        return version if out.returncode == 0 and version else None

    def start(self) -> None:
        with socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET) as s:
            s.settimeout(1)
            if s.connect_ex((self.host, self.port)) == 0:
                raise RuntimeError(
                    f"{self.engine} launch: something already listens on {self.host}:{self.port}; "
                    "stop it, pick another port, or give its url to talk to it"
                )
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old_sigterm = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(self.argv())}\n".encode())
            logf.flush()
            self.proc = subprocess.Popen(
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def returncode(self):
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after stop_timeout_s; then SIGTERM gets its handler back.
        Nothing for a server that is not running."""
        if self.proc is not None and self.proc.poll() is None:
            self._stop_group()
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def _stop_group(self) -> None:
        for sig, wait in ((signal.SIGTERM, self.stop_timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                pass
        with suppress(ProcessLookupError):  # children left in the group after the leader exited
            os.killpg(self.proc.pid, signal.SIGKILL)


def servers(section, folder, dtype: str = "auto"):
    """An ``infer.<engine>`` section (config.Servers) as the engine gets it: its launch, if any, serves ``folder``
    unless it names another model, plus ``--dtype`` unless auto and ``--trust-remote-code`` if remote.trusted."""
    launch = section.launch
    if launch is None:
        return section
    given = shlex.split(launch.extra_args) if isinstance(launch.extra_args, str) else list(launch.extra_args)
    extra = [
        *given,
        *(["--dtype", dtype] if dtype != "auto" else []),
        *(["--trust-remote-code"] if remote.trusted(folder) else []),
    ]
    model = launch.model_path or str(folder)
    if extra == given and model == launch.model_path:
        return section
    return section.model_copy(update={"launch": launch.model_copy(update={"extra_args": extra, "model_path": model})})
