"""Every `pdserve` and `make` command, and every Python example of pdserve or its API, that
README.md and docs/*.md show in a code block runs here as written (issue 46): a default that
breaks one fails the suite, and a doc change is tested the next run. The commands are read
from the docs; one that is neither run nor listed as exempt (with its reason) fails
`test_every_documented_command_is_run_or_exempt`.

"As written" up to the substitutions `substitute` makes, each for a CI machine, all listed
in SUBSTITUTIONS. `pdserve` commands run through `pdserve.cluster.cli.main` (what the
`pdserve` script calls) in this process, except `pdserve serve --model tiny`, which runs as
its own process for the commands that need a server, and stops on SIGTERM. The other
`pdserve serve` lines would each start a cluster (a minute or more on 2 cores): they run the
command line up to the start (parsing, settings, model, keys, ServeConfig), not the start.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from served import Server, alive

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)\s*(\w*)")
MAX_REQUESTS = 4
TINY_PROFILE = ROOT / "bench" / "results" / "profile_tiny_2026-11-27.json"

# What a command is changed by to run here, and why: the only differences from the docs.
SUBSTITUTIONS = {
    "--model": "no --model, or a model this machine does not have (/models/..., a .gguf, `...`, a placeholder "
               "such as <dir>): --model tiny. "
               "The default model is 93 MB to fetch and a minute to compile; its fetch has its own tests "
               "(tests/workers/test_default_model.py)",
    "--port and HAProxy's ports": "free ones: another server may hold 8000 on a CI machine",
    "--base-url, OpenAI(base_url=...)": "the server this module started",
    "--num-requests": f"at most {MAX_REQUESTS} (given or not): the number sizes a load, not the tool",
    "/tmp/..., /etc/pdserve/cluster-secret": "a path under the test's temporary directory (a secret made there)",
    "$KEY": "a key made here",
    "profile's grid": "a small one (--prefill-tokens 64,1024 ...): the default grid takes minutes, --quick's took "
                      "48 s on a loaded 2-core machine",
    "profile.json, once profile has written it": f"{TINY_PROFILE.relative_to(ROOT)}, measured on a quiet machine: "
                                                 "what plan finds (exit 1: nothing meets the SLOs) depends on the "
                                                 "speed of the machine that measured the profile",
    "--trace FILE": "a four-row trace written here, in the doc's format",
}

# Commands not run, and why.
EXEMPT = {
    "make test": "the test suite this file is part of",
    "pdserve make-tiny-pair": "trains for minutes; tests/workers/test_tiny_train.py trains a small pair",
    "pdserve make-tiny-pair OUT_DIR": "as above",
    "pdserve make-tiny-pair OUT_DIR --minutes 9 --seed 1 --threads 1": "as above",
    "RAY_ADDRESS=HEAD:6379 pdserve serve --model /models/m --prefill 2 --decode 2 --prefill-resources "
    "'{\"prefill_node\": 1}' --decode-resources '{\"decode_node\": 1}' --gateway-resources "
    "'{\"gateway_node\": 1}' --cluster-secret-file /etc/pdserve/cluster-secret":
        "joins a Ray cluster of three machines; tests/cluster/test_multinode.py serves on two nodes with "
        "these flags",
}


@dataclass(frozen=True)
class Command:
    doc: str  # where: docs/x.md:LINE
    text: str  # a shell command as its words re-joined (comments and line continuations gone), or Python code
    python: bool = False

    @property
    def key(self) -> str:
        return self.text.splitlines()[0] if self.python else self.text


def documented(paths: list[Path] = DOCS) -> list[Command]:
    """The commands in `paths`' fenced code blocks: shell lines that run `pdserve` or `make`
    (after any VAR=value), Python blocks that import pdserve or the openai client."""
    found = []
    for path in paths:
        block: list[str] | None = None
        lang, start = "", 0
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            fence = FENCE.match(line)
            if fence and block is None:
                block, lang, start = [], fence.group(2), number
            elif fence and block is not None:
                where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{start}"
                found += _python(block, where) if lang == "python" else _shell(block, where)
                block = None
            elif block is not None:
                block.append(line)
    return found


def makefile_recipes(path: Path = ROOT / "Makefile") -> dict[str, Command]:
    """target -> the `pdserve` command its recipe runs, as make expands it (`$(BIN)/pdserve`
    is the venv's pdserve; `$(VAR)` is the Makefile's default): `make X` runs what that runs."""
    text = path.read_text(encoding="utf-8")
    defaults = dict(re.findall(r"^(\w+) \?= (.*)$", text, re.MULTILINE))
    recipes, target = {}, ""
    for number, line in enumerate(text.splitlines(), start=1):
        if re.match(r"^[\w-]+:", line):
            target = line.split(":", 1)[0]
        elif line.startswith("\t$(BIN)/pdserve "):
            command = re.sub(r"\$\((\w+)\)", lambda m: defaults.get(m.group(1), m.group(0)), line[len("\t$(BIN)/"):])
            recipes[target] = Command(f"Makefile:{number}", shlex.join(shlex.split(command)))
    return recipes


def _python(block: list[str], where: str) -> list[Command]:
    code = "\n".join(block)
    wanted = re.search(r"^\s*(from|import) (pdserve|openai)\b", code, re.MULTILINE)
    return [Command(where, code, python=True)] if wanted else []


def _shell(block: list[str], where: str) -> list[Command]:
    commands, logical = [], ""
    for line in block:
        logical += line
        if logical.endswith("\\"):
            logical = logical[:-1]
            continue
        try:
            words = shlex.split(logical, comments=True)
        except ValueError:
            words = []  # not a shell line (an unbalanced quote in prose)
        logical = ""
        program = next((w for w in words if not re.match(r"^\w+=", w)), "")
        if program in ("pdserve", "make"):
            commands.append(Command(where, shlex.join(words)))
    return commands


def test_the_reader_finds_commands_as_the_docs_show_them(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("```bash\npdserve serve --model tiny   # a comment\nls -l\nA=1 pdserve bench \\\n"
                   "    --num-requests 3\n```\nprose pdserve serve\n```python\nfrom pdserve import LLM\nLLM()\n```\n"
                   "```python\nprint(1)\n```\n", encoding="utf-8")
    got = documented([doc])
    assert [c.key for c in got] == ["pdserve serve --model tiny", "A=1 pdserve bench --num-requests 3",
                                    "from pdserve import LLM"]


# -- what runs, and how ---------------------------------------------------------------------------------


def words(c: Command) -> list[str]:
    """The command without its environment assignments."""
    w = shlex.split(c.text)
    return w[next(i for i, x in enumerate(w) if not re.match(r"^\w+=", x)):]


def kind(c: Command) -> str:
    """How `c` runs: "exempt", "recipe" (a make target: its recipe is run), "python", "server"
    (the one served), "serve" (up to the start), "bench" (against the server) or "offline"."""
    if c.key in EXEMPT:
        return "exempt"
    if c.python:
        return "python"
    w = words(c)
    if w[0] == "make":  # what its recipe runs, or a target to list in EXEMPT
        recipe = makefile_recipes().get(w[1]) if len(w) == 2 else None
        return "unknown" if recipe is None else "recipe"  # the recipe is one of COMMANDS
    if w[1:] == ["serve", "--model", "tiny"]:
        return "server"
    return {"serve": "serve", "bench": "bench"}.get(w[1], "offline")


def substitute(w: list[str], tmp: Path, base_url: str = "") -> list[str]:
    """`w` (a pdserve command's words, `pdserve` first) with SUBSTITUTIONS applied."""
    out = list(w)
    sub = out[1]
    if sub in ("serve", "generate", "profile"):
        if "--model" not in out:
            out += ["--model", "tiny"]
        i = out.index("--model") + 1
        if out[i].startswith(("/models/", "./", "<")) or out[i].endswith(".gguf") or out[i] == "...":
            out[i] = "tiny"
    if sub == "bench":
        out = _set(out, "--base-url", base_url)
        n = int(out[out.index("--num-requests") + 1]) if "--num-requests" in out else MAX_REQUESTS
        out = _set(out, "--num-requests", str(min(n, MAX_REQUESTS)))
        if "--trace" in out:
            trace = out[out.index("--trace") + 1]
            rows = [{"timestamp": 200 * i, "input_length": 600, "output_length": 8, "hash_ids": [0, i + 1]}
                    for i in range(4)]
            (tmp / trace).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    if sub == "profile":
        out += ["--prefill-tokens", "64,1024", "--cached", "512:64", "--batches", "1,4", "--contexts", "64,1024",
                "--transfer-tokens", "64,1024", "--repeats", "1", "--decode-steps", "2"]
    out = [str(tmp / x[len("/tmp/"):]) if x.startswith("/tmp/") else x for x in out]
    if "--cluster-secret-file" in out:
        secret = tmp / "cluster-secret"
        secret.write_text(os.urandom(32).hex() + "\n", encoding="utf-8")
        secret.chmod(0o600)
        out = _set(out, "--cluster-secret-file", str(secret))
    return out


def _set(w: list[str], flag: str, value: str) -> list[str]:
    if flag in w:
        w = list(w)
        w[w.index(flag) + 1] = value
        return w
    return [*w, flag, value]


def run_pdserve(argv: list[str]) -> str:
    """`pdserve argv...` in this process: its stdout; AssertionError with its output unless it exits 0."""
    from pdserve.cluster.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    assert code == 0, f"pdserve {shlex.join(argv)}: exit {code}\n{err.getvalue()[-3000:]}\n{out.getvalue()[-2000:]}"
    return out.getvalue()


# The docs' commands, and the Makefile's (`make generate` is what the Makefile's header offers).
COMMANDS = documented() + list(makefile_recipes().values())


def test_every_documented_command_is_run_or_exempt() -> None:
    assert COMMANDS, "no command found: the reader is broken"
    unknown = [f"{c.doc}: {c.key}" for c in COMMANDS if kind(c) == "unknown"]
    assert not unknown, "documented commands this test neither runs nor exempts:\n" + "\n".join(unknown)
    stale = set(EXEMPT) - {c.key for c in COMMANDS}
    assert not stale, f"exempt commands no doc shows any more: {sorted(stale)}"
    assert sum(kind(c) == "server" for c in COMMANDS) >= 1, "no doc shows `pdserve serve --model tiny`"


@pytest.fixture
def in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory the module's commands share (profile.json, then plan reads it)."""
    path = tmp_path_factory.getbasetemp() / "doc-commands"
    path.mkdir(exist_ok=True)
    monkeypatch.chdir(path)
    return path


# Offline commands in the docs' order, except that profile writes the profile.json the others read.
OFFLINE = sorted((c for c in COMMANDS if kind(c) in ("offline", "serve")), key=lambda c: words(c)[1] != "profile")


@pytest.mark.slow
@pytest.mark.parametrize("c", OFFLINE, ids=[f"{c.doc}: {c.key[:60]}" for c in OFFLINE])
def test_an_offline_command_runs_as_written(c: Command, in_tmp: Path, monkeypatch: pytest.MonkeyPatch,
                                           server: Server) -> None:
    del server  # started now: it boots while the offline commands run
    argv = substitute(words(c), in_tmp)
    for assignment in shlex.split(c.text)[: shlex.split(c.text).index("pdserve")]:
        name, _, value = assignment.partition("=")
        monkeypatch.setenv(name, "a-key-made-here" if value.startswith("$") else value)
    if argv[1] == "serve":  # the command line up to the start (see the module's docstring)
        from pdserve.cluster import shutdown

        started = []
        monkeypatch.setattr(shutdown, "serve_in_own_group", lambda serve: serve())
        monkeypatch.setattr(shutdown, "run_until_stopped", lambda cfg: started.append(cfg) or 0)
        run_pdserve(argv[1:])
        assert len(started) == 1 and started[0].model
        return
    out = run_pdserve(argv[1:])
    if argv[1] == "generate":
        assert "finish_reason=" in out
    if argv[1] == "make-tiny-model":
        assert (Path(argv[2]) / "config.json").is_file()
    if argv[1] == "profile":
        from pdserve.cluster.planner.profile import Profile

        written = in_tmp / argv[argv.index("--out") + 1]
        assert Profile.load(written).costs() is not None
        shutil.copyfile(TINY_PROFILE, written)  # what the next commands read (SUBSTITUTIONS)


# -- the server, and what runs against it ----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The docs' `pdserve serve --model tiny`, started when the first offline command runs, so
    that it boots while they do; the commands that need it wait until it serves."""
    pytest.importorskip("ray")
    s = Server(words(next(c for c in COMMANDS if kind(c) == "server"))[2:],
               tmp_path_factory.mktemp("server") / "stderr.txt").start()
    try:
        yield s
    finally:
        s.kill()


PYTHON = [c for c in COMMANDS if kind(c) == "python"]
BENCH = [c for c in COMMANDS if kind(c) == "bench"]


@pytest.mark.slow
@pytest.mark.parametrize("c", PYTHON, ids=[f"{c.doc}: {c.key[:60]}" for c in PYTHON])
def test_a_python_example_runs_as_written(c: Command, in_tmp: Path, request: pytest.FixtureRequest) -> None:
    code = c.text
    if "OpenAI(" in code:
        url = request.getfixturevalue("server").wait_ready().url
        code = code.replace("http://127.0.0.1:8000/v1", url)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, c.doc, "exec"), {"__name__": "__doc_example__"})  # noqa: S102 - the docs' own code
    if "print(" in code:
        assert out.getvalue().strip(), "the example printed nothing"


@pytest.mark.slow
@pytest.mark.parametrize("c", BENCH, ids=[f"{c.doc}: {c.key[:60]}" for c in BENCH])
def test_a_bench_command_runs_against_the_server(c: Command, in_tmp: Path, server: Server) -> None:
    argv = substitute(words(c), in_tmp, base_url=server.wait_ready().url)
    run_pdserve(argv[1:])
    for flag in ("--result-json", "--plot-dir"):
        if flag in argv:
            assert (in_tmp / argv[argv.index(flag) + 1]).exists(), flag


@pytest.mark.slow
def test_the_server_stops_on_sigterm(server: Server) -> None:
    """Last: the docs' server, stopped as systemd stops it (tests/cluster/test_clean_stop.py has every case)."""
    server.wait_ready()
    assert server.proc is not None
    os.killpg(server.proc.pid, signal.SIGTERM)
    assert server.proc.wait(60) == 0, server.stderr()[-3000:]
    assert not alive(server.started)
