"""Run Python under an audit hook that logs every file opened, changed or program started.

A ``sitecustomize.py`` in a temporary folder on PYTHONPATH installs the hook (PEP 578,
``sys.addaudithook``) in every Python process of the tree - the child, its subprocesses,
DataLoader workers, a Jupyter kernel - and each appends its events as JSON lines to the file
that $LABKIT_AUDIT_LOG names. Tests then ask which paths were opened for writing and which
programs were started:

    events = run_audited(["-m", "labkit", "doctor", "--json"], tmp_path).events
    assert writes_outside(events, [tmp_path]) == []
    assert programs(events) == []          # or only ["nvidia-smi", "--query-gpu=...", ...]

Only Python-level operations are seen: a C library writing through its own syscalls is not,
but nothing in labkit does that; a program started is seen, and its own actions are not.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

LOG_VARIABLE = "LABKIT_AUDIT_LOG"
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_EXCL
CHANGES = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.truncate", "os.chmod",
           "os.chown", "os.link", "os.symlink", "os.utime", "shutil.rmtree", "shutil.copyfile",
           "shutil.copymode", "shutil.copystat", "resource.setrlimit")
STARTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "pty.spawn")
FORKS = ("os.fork", "os.forkpty")          # a copy of this process, not a new program

# The hook: opened once per process with os.open (no recursion: os.write raises no event).
SITECUSTOMIZE = f'''
import json as _json, os as _os, sys as _sys

_fd = _os.open(_os.environ[{LOG_VARIABLE!r}], _os.O_WRONLY | _os.O_APPEND | _os.O_CREAT, 0o600)
_WRITE = {WRITE_FLAGS}
_CHANGES, _STARTS, _FORKS = {CHANGES!r}, {STARTS!r}, {FORKS!r}


def _text(value):
    return _os.fsdecode(value) if isinstance(value, (str, bytes, _os.PathLike)) else repr(value)


def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        write = bool((flags or 0) & _WRITE) or any(c in (mode or "") for c in "wax+")
        record = {{"event": "open", "path": _text(path), "mode": mode, "flags": flags,
                   "write": write}}
    elif event in _CHANGES:                    # the paths (a rename has two), or the rlimit
        record = {{"event": event, "paths": [_text(a) for a in args[:2]
                                             if isinstance(a, (str, bytes, _os.PathLike))],
                   "args": [repr(a) for a in args]}}
    elif event in _STARTS:                     # os.system(command); the others (path, argv, ...)
        argv = args[0] if event == "os.system" else args[1]
        argv = [_text(a) for a in argv] if isinstance(argv, (list, tuple)) else [_text(argv)]
        record = {{"event": event, "argv": argv}}
    elif event in _FORKS:
        record = {{"event": event}}
    else:
        return
    record["pid"] = _os.getpid()
    _os.write(_fd, (_json.dumps(record) + "\\n").encode())


_sys.addaudithook(_hook)
'''


@dataclass
class AuditRun:
    """What the audited process printed, and every event its process tree logged."""

    returncode: int
    stdout: str
    stderr: str
    events: list[dict]


def audit_env(folder: Path, env: dict | None = None) -> dict:
    """An environment whose Python processes log to ``folder``/audit.jsonl (hook installed)."""
    folder = Path(folder)
    hook_dir = folder / "audit_hook"
    hook_dir.mkdir(parents=True, exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook_dir), env.get("PYTHONPATH")]))
    env[LOG_VARIABLE] = str(folder / "audit.jsonl")
    env["PYTHONDONTWRITEBYTECODE"] = "1"      # else importing writes __pycache__ into the repo
    return env


def read_events(folder: Path) -> list[dict]:
    log = Path(folder) / "audit.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def run_audited(args: list[str], folder: Path, env: dict | None = None,
                timeout: float = 120, cwd=None) -> AuditRun:
    """Run ``python *args`` (e.g. ["-c", code] or ["-m", "labkit", "doctor"]) under the hook."""
    done = subprocess.run([sys.executable, *args], env=audit_env(folder, env), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    return AuditRun(done.returncode, done.stdout, done.stderr, read_events(folder))


def _inside(path: str, folders) -> bool:
    resolved = os.path.realpath(path)
    return any(resolved == str(f) or resolved.startswith(str(f) + os.sep)
               for f in map(os.path.realpath, folders))


def writes_outside(events: list[dict], allowed) -> list[dict]:
    """Opens for writing, and file changes (or a setrlimit), anywhere but under ``allowed``."""
    bad = []
    for e in events:
        if e["event"] == "open" and e["write"] and not _inside(e["path"], allowed):
            bad.append(e)
        elif e["event"] in CHANGES and not (e["paths"] and
                                            all(_inside(p, allowed) for p in e["paths"])):
            bad.append(e)
    return bad


def programs(events: list[dict]) -> list[dict]:
    """The command line of every program started in the process tree (forks are not)."""
    return [e["argv"] for e in events if e["event"] in STARTS]
