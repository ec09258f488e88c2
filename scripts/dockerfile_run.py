"""Read a Dockerfile as the builder does, and run its RUN steps on this machine, in order.

The course's machines have the ``docker`` client but no engine, so the Dockerfile is checked in
two ways instead of ``docker build``:

* ``parse`` reads it by the rules of the Dockerfile reference (docs.docker.com/reference/dockerfile):
  parser directives, comment lines, line continuations (also across comment lines), JSON (exec)
  and shell forms, and ARG/ENV substitution (``$V``, ``${V}``, ``${V:-word}``, ``${V:+word}``) in
  the instructions the builder substitutes. RUN, CMD and ENTRYPOINT are not substituted by the
  builder: their shell does it, with ARG and ENV values in its environment.
* ``run`` replays a stage on the host inside one temporary folder: the build context is a copy of
  the repository's files (``git ls-files``, less .dockerignore), container paths are mapped under
  a temporary root, COPY copies for real, and RUN goes to ``/bin/sh -c`` with a fresh virtual
  environment first on PATH standing in for the image's python. A RUN preceded by the comment
  ``# dockerfile_run: skip`` (a step that only makes sense inside an image, such as useradd) is
  reported as skipped, never run. Nothing is written outside the temporary folder.

    python scripts/dockerfile_run.py --build-arg TORCH_INDEX_URL= Dockerfile
"""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

INSTRUCTIONS = ("ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK",
                "LABEL", "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME",
                "WORKDIR")
# the builder substitutes variables in these (Dockerfile reference, "Environment replacement")
SUBSTITUTED = ("ADD", "COPY", "ENV", "EXPOSE", "FROM", "LABEL", "STOPSIGNAL", "USER", "VOLUME",
               "WORKDIR", "ONBUILD")
SKIP_MARKER = "dockerfile_run: skip"
REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction: its keyword, the raw text after it, where it starts, and the comment
    lines just above it (where the skip marker lives)."""
    keyword: str
    text: str
    line: int
    comments: tuple[str, ...] = ()

    @property
    def exec_form(self) -> list[str] | None:
        """The JSON array of ``CMD ["a", "b"]``, or None for the shell form."""
        if not self.text.startswith("["):
            return None
        try:
            value = json.loads(self.text)
        except json.JSONDecodeError:
            return None                  # the builder then treats it as the shell form
        return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None

    @property
    def skipped(self) -> bool:
        return any(SKIP_MARKER in c for c in self.comments)


@dataclasses.dataclass(frozen=True)
class Step:
    """What ``run`` did with one instruction."""
    line: int
    keyword: str
    command: str
    returncode: int
    seconds: float
    skipped: bool = False
    output_tail: str = ""


@dataclasses.dataclass(frozen=True)
class Build:
    """The replayed stage: every step, and the image settings the last instructions left."""
    steps: list[Step]
    env: dict[str, str]
    workdir: str
    user: str
    cmd: list[str] | None
    expose: list[str]
    root: Path
    venv: Path
    seconds: float

    @property
    def ok(self) -> bool:
        return all(s.returncode == 0 for s in self.steps)


def parse(text: str) -> list[Instruction]:
    """Split a Dockerfile into instructions; an unknown keyword raises ValueError."""
    lines = text.splitlines()
    escape, start = "\\", 0
    for start, raw in enumerate(lines):       # parser directives: only before anything else
        m = re.fullmatch(r"#\s*(\w+)\s*=\s*(\S+)\s*", raw)
        if not m:
            break
        if m.group(1).lower() == "escape":
            escape = m.group(2)
    else:
        start = len(lines)
    out: list[Instruction] = []
    comments: list[str] = []
    i = start
    while i < len(lines):
        stripped = lines[i].strip()
        if not stripped:
            comments, i = [], i + 1
            continue
        if stripped.startswith("#"):
            comments.append(stripped)
            i += 1
            continue
        first, parts = i, []
        while True:                             # a trailing escape joins the next line
            line = lines[i].rstrip()
            if line.endswith(escape) and i + 1 < len(lines):
                parts.append(line[:-len(escape)])
                i += 1
                while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith("#")):
                    i += 1                      # comment and empty lines inside are dropped
                if i >= len(lines):
                    break
                continue
            parts.append(line)
            i += 1
            break
        joined = " ".join(p.strip() for p in parts).strip()
        keyword, _, rest = joined.partition(" ")
        if keyword.upper() not in INSTRUCTIONS:
            raise ValueError(f"line {first + 1}: unknown instruction {keyword!r}; a Dockerfile "
                             f"knows {', '.join(INSTRUCTIONS)}")
        out.append(Instruction(keyword.upper(), rest.strip(), first + 1, tuple(comments)))
        comments = []
    return out


def substitute(word: str, env: dict[str, str]) -> str:
    """Expand ``$V``, ``${V}``, ``${V:-default}`` and ``${V:+alternative}`` as the builder does;
    ``\\$`` keeps a literal dollar sign."""
    def one(m: re.Match) -> str:
        if m.group(0) == "\\$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3) or ""
        value = env.get(name)
        if op == ":-":
            return value if value else substitute(arg, env)
        if op == ":+":
            return substitute(arg, env) if value else ""
        return value or ""
    return re.sub(r"\\\$|\$\{(\w+)(?:(:[-+])([^}]*))?\}|\$(\w+)", one, word)


def flags(text: str) -> tuple[dict[str, str], str]:
    """Split leading ``--name=value`` flags (COPY --chown, FROM --platform) from the arguments."""
    found: dict[str, str] = {}
    while True:
        m = re.match(r"--([\w-]+)(?:=(\S*))?\s*", text)
        if not m:
            return found, text
        found[m.group(1)] = m.group(2) or ""
        text = text[m.end():]


def assignments(text: str, env: dict[str, str], keyword: str) -> dict[str, str]:
    """``ENV A=1 B="two words"`` (or the old ``ENV A 1``) and ``LABEL``, substituted."""
    words = shlex.split(text, posix=True)
    if words and "=" not in words[0]:
        if keyword != "ENV" or len(words) < 2:
            raise ValueError(f"{keyword} {text!r}: write NAME=value")
        return {words[0]: substitute(" ".join(words[1:]), env)}
    pairs = {}
    for w in words:
        name, eq, value = w.partition("=")
        if not eq:
            raise ValueError(f"{keyword} {text!r}: {w!r} has no '=', write NAME=value")
        pairs[name] = substitute(value, env)
    return pairs


def stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    """The instructions of each stage (each starts with its FROM); global ARGs come first."""
    out: list[list[Instruction]] = [[]]
    for ins in instructions:
        if ins.keyword == "FROM":
            out.append([])
        out[-1].append(ins)
    return out


def stage_names(instructions: list[Instruction]) -> list[str]:
    """The ``AS name`` of every FROM, in order (an empty string where there is none)."""
    names = []
    for ins in instructions:
        if ins.keyword == "FROM":
            words = flags(ins.text)[1].split()
            names.append(words[2].lower() if len(words) == 3 and words[1].lower() == "as" else "")
    return names


def dockerignore(context: Path) -> list[str]:
    """The patterns of ``context/.dockerignore``, comments and blank lines dropped."""
    path = context / ".dockerignore"
    if not path.exists():
        return []
    return [p.strip().rstrip("/") for p in path.read_text().splitlines()
            if p.strip() and not p.strip().startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    """Whether .dockerignore leaves ``rel`` out of the context: the last matching pattern wins,
    ``!`` re-includes, a pattern that matches a folder covers what is inside it, and ``**/``
    matches at any depth. (``*`` here also crosses ``/``, unlike Go's filepath.Match: keep the
    patterns simple.)"""
    parts = rel.strip("/").split("/")
    out = False
    for p in patterns:
        negate, pat = p.startswith("!"), p.lstrip("!").strip("/")
        anywhere = pat.startswith("**/")
        pat = pat[3:] if anywhere else pat
        firsts = range(len(parts)) if anywhere else (0,)
        names = ["/".join(parts[j:k]) for j in firsts for k in range(j + 1, len(parts) + 1)]
        if any(fnmatch.fnmatchcase(n, pat) for n in names):
            out = not negate
    return out


def context_files(repo: Path = REPO) -> list[str]:
    """The build context: the repository's tracked and new (not git-ignored) files, less
    .dockerignore; every file of a folder that is not a git repository."""
    if (repo / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                                 "-z"], cwd=repo, check=True, capture_output=True).stdout
        listed = listed.decode().split("\0")
    else:
        listed = [str(f.relative_to(repo)) for f in repo.rglob("*")]
    patterns = dockerignore(repo)
    return sorted(f for f in listed if f and (repo / f).is_file() and not ignored(f, patterns))


def copy_sources(ins: Instruction, env: dict[str, str]) -> tuple[list[str], str, dict[str, str]]:
    """The sources, destination and flags of a COPY or ADD (shell or JSON form), substituted."""
    found, rest = flags(ins.text)
    words = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
    words = [substitute(w, env) for w in words]
    if len(words) < 2:
        raise ValueError(f"line {ins.line}: {ins.keyword} needs a source and a destination")
    return words[:-1], words[-1], found


def in_context(src: str, files: set[str]) -> bool:
    """Whether a COPY source names a file, a folder or a glob of the build context."""
    src = src.strip("/") if src not in (".", "./") else "."
    return (src == "." and bool(files)) or src in files \
        or any(f.startswith(src + "/") or fnmatch.fnmatchcase(f, src) for f in files)


def problems(path: Path, context: Path = REPO) -> list[str]:
    """What would stop ``docker build`` before any RUN, or leave the image half-made: an ARG
    without a default, a COPY source missing from the context (or .dockerignored), a COPY --from
    an unknown stage, a final stage without EXPOSE, CMD or USER. An empty list: the file is sound."""
    instructions = parse(path.read_text())
    found = []
    if not instructions or instructions[0].keyword not in ("FROM", "ARG"):
        found.append("the first instruction must be FROM (or ARG before FROM)")
    files = set(context_files(context))
    patterns = dockerignore(context)
    names = stage_names(instructions)
    seen_stages = 0
    for ins in instructions:
        if ins.keyword == "FROM":
            seen_stages += 1
        if ins.keyword == "ARG" and "=" not in ins.text:
            found.append(f"line {ins.line}: ARG {ins.text} has no default; write ARG {ins.text}=...")
        if ins.keyword in ("COPY", "ADD"):
            sources, _, opts = copy_sources(ins, {})
            if "from" in opts:
                earlier = names[:seen_stages - 1]
                image = "/" in opts["from"] or ":" in opts["from"]      # an image, not a stage
                index = opts["from"].isdigit() and int(opts["from"]) < len(earlier)
                if opts["from"].lower() not in earlier and not image and not index:
                    found.append(f"line {ins.line}: COPY --from={opts['from']} names no earlier stage")
                continue
            for src in sources:
                if re.match(r"https?://", src):
                    continue
                if src not in (".", "./") and ignored(src, patterns):
                    found.append(f"line {ins.line}: {src} is excluded by .dockerignore")
                elif not in_context(src, files):
                    found.append(f"line {ins.line}: COPY source {src} is not in the repository")
    last = stages(instructions)[-1]
    for keyword in ("EXPOSE", "CMD", "USER"):
        if not any(i.keyword == keyword for i in last):
            found.append(f"the final stage has no {keyword}")
    return found


def _host_env(home: Path, venv: Path) -> dict[str, str]:
    """The environment RUN sees before the Dockerfile's own ARG/ENV: this machine's settings
    (pip's find-links and indexes among them), a temporary HOME and the venv first on PATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    user_pip = Path.home() / ".config" / "pip" / "pip.conf"
    if "PIP_CONFIG_FILE" not in env and user_pip.exists():
        env["PIP_CONFIG_FILE"] = str(user_pip)   # read, never written: HOME moves to the temp dir
    env.update(HOME=str(home), VIRTUAL_ENV=str(venv),
               PATH=f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin")
    return env


def _copy(context: Path, sources: list[str], dest: Path, dest_is_dir: bool) -> None:
    """COPY's rules: a folder's contents go into the destination; files go into it when it is a
    folder (trailing slash or several sources) and become it otherwise."""
    for src in sources:
        matches = sorted(context.glob(src)) if any(c in src for c in "*?[") else [context / src]
        for item in matches:
            if item.is_dir():
                shutil.copytree(item, dest, dirs_exist_ok=True)
            else:
                target = dest / item.name if dest_is_dir else dest
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(item, target)


def run(path: Path, tmp: Path, build_args: dict[str, str] | None = None, repo: Path = REPO,
        timeout: float = 1800, with_pip: bool = True) -> Build:
    """Replay the last stage of ``path`` on this machine under ``tmp`` (see the module
    docstring); stops at the first failing RUN. ``with_pip=False`` makes the venv in a tenth
    of the time, for Dockerfiles whose RUN steps do not install."""
    start = time.perf_counter()
    build_args = dict(build_args or {})
    instructions = parse(path.read_text())
    context, root, home, venv = tmp / "context", tmp / "root", tmp / "home", tmp / "venv"
    for f in context_files(repo):
        (context / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / f, context / f)
    root.mkdir(parents=True), home.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "venv", *([] if with_pip else ["--without-pip"]),
                    str(venv)], check=True, capture_output=True)
    base = _host_env(home, venv)
    head, *rest = stages(instructions)
    globals_ = {}
    for ins in head:                              # ARGs before FROM: visible to FROM only
        name, _, default = ins.text.partition("=")
        globals_[name] = build_args.get(name, default)
    args: dict[str, str] = {}
    env: dict[str, str] = {}
    workdir, user, cmd, expose, steps = "/", "root", None, [], []
    for ins in rest[-1] if rest else []:
        scope = {**globals_, **args, **env}
        if ins.keyword == "ARG":
            name, eq, default = ins.text.partition("=")
            args[name] = build_args.get(name, globals_.get(name, "") if not eq else default)
        elif ins.keyword == "ENV":
            env.update(assignments(ins.text, {**args, **env}, "ENV"))
        elif ins.keyword == "WORKDIR":
            workdir = os.path.normpath(os.path.join(workdir, substitute(ins.text, scope)))
            (root / workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
        elif ins.keyword == "USER":
            user = substitute(ins.text, scope)
        elif ins.keyword == "EXPOSE":
            expose += substitute(ins.text, scope).split()
        elif ins.keyword == "CMD":
            cmd = ins.exec_form or ["/bin/sh", "-c", ins.text]
        elif ins.keyword in ("COPY", "ADD"):
            sources, dest, _ = copy_sources(ins, scope)
            target = root / os.path.join(workdir, dest).lstrip("/")
            _copy(context, sources, target, dest.endswith("/") or dest in (".", "./")
                  or len(sources) > 1)
            steps.append(Step(ins.line, ins.keyword, ins.text, 0, 0.0))
        elif ins.keyword == "RUN":
            _, command = flags(ins.text)
            argv = ins.exec_form or ["/bin/sh", "-c", command]
            if ins.skipped:
                steps.append(Step(ins.line, "RUN", command, 0, 0.0, skipped=True))
                continue
            t0 = time.perf_counter()
            proc = subprocess.run(argv, cwd=root / workdir.lstrip("/"), env={**base, **args, **env},
                                  capture_output=True, text=True, timeout=timeout)
            steps.append(Step(ins.line, "RUN", command, proc.returncode, time.perf_counter() - t0,
                              output_tail=(proc.stdout + proc.stderr)[-3000:]))
            if proc.returncode:
                break
    return Build(steps, env, workdir, user, cmd, expose, root, venv, time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dockerfile", nargs="?", default=str(REPO / "Dockerfile"))
    parser.add_argument("--build-arg", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--check", action="store_true", help="only parse and check, run nothing")
    opts = parser.parse_args(argv)
    path = Path(opts.dockerfile)
    found = problems(path)
    for p in found:
        print("problem:", p)
    if opts.check or found:
        return 1 if found else 0
    build_args = dict(a.partition("=")[::2] for a in opts.build_arg)
    with tempfile.TemporaryDirectory(prefix="dockerfile_run-") as tmp:
        build = run(path, Path(tmp), build_args)
    for s in build.steps:
        state = "skipped" if s.skipped else ("ok" if s.returncode == 0 else f"exit {s.returncode}")
        print(f"line {s.line:3d}  {s.keyword:4s}  {state:8s} {s.seconds:6.1f} s  {s.command[:70]}")
        if s.returncode:
            print(s.output_tail)
    print(f"total {build.seconds:.1f} s; CMD {build.cmd}; USER {build.user}; EXPOSE {build.expose}")
    return 0 if build.ok else 1


if __name__ == "__main__":
    sys.exit(main())
