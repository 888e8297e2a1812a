"""``infer.sglang.launch``: the infer stage starts ``python -m sglang.launch_server`` itself and always stops it.

    launch:
      model_path: /models/Kimi-K2.5   # --model-path (required)
      tp: 8                           # --tp
      dp: 1                           # --dp
      host: 127.0.0.1                 # --host
      port: 30000                     # --port; the client talks to http://host:port
      extra_args: [--trust-remote-code, --mem-fraction-static, "0.9"]   # a list, or one string split like a shell
      command: null                   # what to run instead of [python, -m, sglang.launch_server]
      log: null                       # the server's output; default .cache/sglang/server-<port>.log
      stop_timeout_s: 60              # SIGTERM, then SIGKILL after this long

The server runs in its own process group, stopped as a group (SGLang starts scheduler and detokenizer processes);
on Linux it also gets SIGTERM if the stage dies without cleaning up (kill -9). This file is not part of the cache
fingerprint: how a server is started does not decide its ids (the engine reads what the server reports instead).
"""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..config import CACHE


def _die_with_parent():  # pragma: no cover - runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LaunchedServer:
    def __init__(self, cfg):
        """``cfg``: ``infer.sglang.launch`` (config.Launch)."""
        self.model_path, self.tp, self.dp, self.host, self.port = cfg.model_path, cfg.tp, cfg.dp, cfg.host, cfg.port
        extra = cfg.extra_args
        self.extra_args = shlex.split(extra) if isinstance(extra, str) else list(extra)
        command = cfg.command or [sys.executable, "-m", "sglang.launch_server"]
        self.command = shlex.split(command) if isinstance(command, str) else list(command)
        self.log_path = Path(cfg.log) if cfg.log else CACHE / "sglang" / f"server-{self.port}.log"
        self.stop_timeout_s = cfg.stop_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def argv(self) -> list[str]:
        return [*self.command, "--model-path", self.model_path, "--tp", str(self.tp), "--dp", str(self.dp),
                "--host", self.host, "--port", str(self.port), *self.extra_args]

    def describe(self) -> dict:
        return {"argv": self.argv()[len(self.command):], "log": str(self.log_path)}

    def start(self) -> None:
        with socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET) as s:
            s.settimeout(1)
            if s.connect_ex((self.host, self.port)) == 0:
                raise RuntimeError(f"infer.sglang.launch: something already listens on {self.host}:{self.port}; "
                                   "stop it, pick another port, or use infer.sglang.urls to talk to it")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(self.argv())}\n".encode())
            logf.flush()
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_parent)

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def returncode(self):
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after stop_timeout_s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, self.stop_timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children left in the group after the leader exited
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
