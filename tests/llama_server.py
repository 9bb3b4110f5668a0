"""A real llama.cpp ``llama-server`` for tests: a tiny model written here, the binary, the process.

What it gives (see /work/shared/BACKENDS.md for the measurements behind it):

- :func:`write_tiny_model` writes a Llama-architecture GGUF with random weights whose generations
  never end early: every completion is exactly ``max_tokens`` tokens of plain ASCII with
  ``finish_reason == "length"``, so tests can assert exact token counts.
- :func:`find_llama_server` finds the binary; :func:`require_llama_server` skips a test without it,
  or fails it when ``APSD_REQUIRE_BACKENDS=1`` (CI sets that, so CI never silently skips).
- :func:`open_llama_server` runs one server on a free loopback port for the body of an
  ``async with`` and always stops it.
- Fixtures, imported explicitly by the tests that use them:
  ``from .llama_server import llama_server, llama_server_binary, tiny_model`` (a fixture's own
  fixtures must be imported too).

The binary comes from ``.ci/build-llama-server``, which builds it from the llama-cpp-python sdist
on PyPI and caches it under ``~/.cache/apsd/llama-server/<version>-<flags hash>/``. Nothing is
downloaded at test time.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import gguf
import httpx
import numpy as np
import pytest
import trio

#: Environment: the binary to use, overriding every other place.
BINARY_ENV = "APSD_LLAMA_SERVER"
#: Environment: "1" turns a missing backend from a skip into a failure (CI sets it).
REQUIRE_ENV = "APSD_REQUIRE_BACKENDS"

#: SentencePiece's stand-in for a space.
SPACE = "\u2581"

_WORDS = (
    "the of and to in is it that for on was with as at by be this are or from an not but have all "
    "one can had were which their there out if about up more when will so no what time some my "
    "than into them these could two other new like only then its over also after first well way "
    "even because any most us where through much before right back good long day work"
).split()

#: The default ordinary pieces: printable ASCII characters, the space, a space before each letter,
#: and some words. ``<``, ``>`` and ``|`` are left out so that no output can spell a chat-template
#: marker such as ``<|im_end|>`` (a stop string for some templates): prompts still use them, as
#: byte tokens.
DEFAULT_PIECES: tuple[str, ...] = (
    tuple(chr(c) for c in range(33, 127) if chr(c) not in "<>|")
    + (SPACE,)
    + tuple(SPACE + chr(c) for c in range(ord("a"), ord("z") + 1))
    + tuple(SPACE + w for w in _WORDS)
)

#: Single characters only: any text tokenizes into one piece per character, so a stream's text
#: tokenizes back into the very tokens the model generated (as a real model's text mostly does; with
#: :data:`DEFAULT_PIECES` a random model's choices, `` its`` after ``q``, say, read back as other pieces).
#: A preempted stream's continuation then matches the state the server kept of it.
CHARACTER_PIECES: tuple[str, ...] = tuple(chr(c) for c in range(33, 127) if chr(c) not in "<>|") + (SPACE,)

#: A ChatML template. llama-server renders it with its Jinja engine (on by default); it is also one
#: that llama.cpp recognises without Jinja. Without any template /v1/chat/completions fails.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: Parameters of :func:`write_tiny_model` for a model slow enough (~125-370 tokens/s on one thread of
#: this machine kind, depending on load) that concurrent requests overlap in time. ~85 MB of F32.
SLOW_MODEL: dict[str, int] = {"hidden": 512, "layers": 8, "heads": 8, "ffn": 1024}

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
_FIRST_ORDINARY = 3 + 256


def write_tiny_model(
    path: str | os.PathLike[str],
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    ffn: int = 128,
    vocab_pieces: Sequence[str] = DEFAULT_PIECES,
    seed: int = 0,
    context_length: int = 8192,
    logit_scale: float = 16.0,
) -> Path:
    """Write a random-weight Llama GGUF (F32) that llama.cpp loads; return its path.

    Vocabulary (SentencePiece ``llama`` tokenizer): ``<unk>`` 0, ``<s>`` 1 (BOS), ``</s>`` 2 (EOS),
    the 256 byte tokens ``<0x00>``..``<0xFF>``, then ``vocab_pieces`` (ASCII, ``▁`` for a space).

    Deterministic lengths: the output-projection rows of the special and byte tokens are zero, so
    their logit is always 0. The ordinary tokens' rows come in ``+v``/``-v`` pairs of length
    ``logit_scale``: for any hidden state one of each pair is positive, and the best ordinary logit
    is ~3 x ``logit_scale`` (~48), so EOS (e^-48 against it) is never sampled, even at temperature 1
    without top-k. A completion therefore runs to ``max_tokens`` and its text is ASCII.

    The same arguments write the same bytes. ``SLOW_MODEL`` holds the arguments of a slower model.
    """
    path = Path(path)
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
    pieces = list(vocab_pieces)
    if len(pieces) < 2 or len(set(pieces)) != len(pieces):
        raise ValueError("vocab_pieces: at least two, all distinct")
    for piece in pieces:
        if not piece or not piece.replace(SPACE, " ").isascii() or piece.startswith("<0x"):
            raise ValueError(f"vocab_pieces: {piece!r} is not an ordinary ASCII piece")

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    n_vocab = len(tokens)
    T = gguf.TokenType
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256 + [T.NORMAL] * len(pieces)
    # SentencePiece merges the best-scoring pair first; longer pieces win.
    scores = [0.0] * _FIRST_ORDINARY + [float(len(p)) - i * 1e-4 for i, p in enumerate(pieces)]

    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def dense(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    n_pairs = len(pieces) // 2
    directions = rng.standard_normal((n_pairs, hidden))
    directions *= logit_scale / np.linalg.norm(directions, axis=1, keepdims=True)
    output = np.zeros((n_vocab, hidden), dtype=np.float32)
    ordinary = output[_FIRST_ORDINARY:]
    ordinary[0 : 2 * n_pairs : 2] = directions
    ordinary[1 : 2 * n_pairs : 2] = -directions
    if len(pieces) % 2:  # the odd one out repeats a direction: harmless
        ordinary[-1] = directions[0]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("apsd-tiny-test-model")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(context_length)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)

    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types([int(t) for t in types])
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    ones = np.ones(hidden, dtype=np.float32)
    writer.add_tensor("token_embd.weight", rng.standard_normal((n_vocab, hidden)).astype(np.float32))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.attn_q.weight", dense(hidden, hidden))
        writer.add_tensor(f"blk.{i}.attn_k.weight", dense(hidden, hidden))
        writer.add_tensor(f"blk.{i}.attn_v.weight", dense(hidden, hidden))
        writer.add_tensor(f"blk.{i}.attn_output.weight", dense(hidden, hidden))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", dense(ffn, hidden))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", dense(ffn, hidden))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", dense(hidden, ffn))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", output)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_server_cache_dir() -> Path:
    """Where ``.ci/build-llama-server`` caches its builds, one folder per version and flags."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "apsd" / "llama-server"


def find_llama_server() -> str | None:
    """The ``llama-server`` binary to use, or None.

    In order: ``$APSD_LLAMA_SERVER`` when set (returned as given, even if nothing is there:
    :func:`require_llama_server` then fails rather than fall back); ``llama-server`` on PATH; the
    newest executable in :func:`llama_server_cache_dir`.
    """
    explicit = os.environ.get(BINARY_ENV)
    if explicit:
        return explicit
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path
    cached = [p for p in llama_server_cache_dir().glob("*/llama-server") if os.access(p, os.X_OK)]
    if cached:
        return str(max(cached, key=lambda p: p.stat().st_mtime))
    return None


def require_llama_server() -> str:
    """The binary's path for a test that needs it; otherwise skip the test, or fail it in CI.

    Fails (``pytest.fail``) instead of skipping when ``$APSD_REQUIRE_BACKENDS`` is ``1``, and
    always when ``$APSD_LLAMA_SERVER`` names something that is not an executable file.
    """
    binary = find_llama_server()
    explicit = os.environ.get(BINARY_ENV)
    if explicit and not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
        pytest.fail(f"${BINARY_ENV}={explicit!r} is not an executable file", pytrace=False)
    if binary is None:
        reason = (
            f"llama-server not found (${BINARY_ENV}, PATH, {llama_server_cache_dir()}); "
            "build it with .ci/build-llama-server"
        )
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason}; ${REQUIRE_ENV}=1 forbids skipping", pytrace=False)
        pytest.skip(reason)
    return binary


class LlamaServerError(RuntimeError):
    """llama-server did not start; the message ends with the tail of its log."""


@attrs.frozen
class LlamaServer:
    """A running llama-server, as yielded by :func:`open_llama_server`."""

    url: str  #: ``http://127.0.0.1:PORT``, without ``/v1``
    port: int
    process: trio.Process
    alias: str  #: the model name it lists in /v1/models
    model_path: Path
    log_path: Path  #: its stdout and stderr; removed when the server's context exits

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)


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


#: How often a port taken between choosing it and llama-server binding it is retried.
_START_ATTEMPTS = 3
_POLL_INTERVAL = 0.05


@asynccontextmanager
async def open_llama_server(
    model_path: str | os.PathLike[str],
    *,
    alias: str = "tiny",
    parallel: int = 4,
    ctx: int = 8192,
    extra_args: Sequence[str] = (),
    binary: str | None = None,
    startup_timeout: float = 30.0,
    stop_timeout: float = 5.0,
    log_dir: str | os.PathLike[str] | None = None,
) -> AsyncIterator[LlamaServer]:
    """Run ``llama-server`` on a free 127.0.0.1 port; yield a :class:`LlamaServer` once /health is 200.

    The command is ``llama-server -m MODEL --alias ALIAS --host 127.0.0.1 --port P -c CTX -np
    PARALLEL -t 1 -tb 1 --metrics`` plus ``extra_args``. ``-np`` is the number of slots (requests
    decoded together); ``-c`` is split between them. One thread: two stall on a busy 2-core machine.

    Resource handling: the process is this context's own. On exit, whether the body returned,
    raised or was cancelled, it gets SIGTERM by its PID, then SIGKILL after ``stop_timeout``
    seconds, and is reaped (in a shielded scope). Its stdout and stderr go to a log file in
    ``log_dir`` (kept) or in a temporary directory (removed on exit).

    Error handling: :class:`LlamaServerError`, ending with the log's tail, if the binary is missing,
    the process exits early, or /health does not answer 200 within ``startup_timeout`` seconds (real
    time: not for use under a virtual clock). A port taken by someone else between choosing and
    binding is retried on a new port, up to 3 times. An exception from the body gets the log's tail
    added as a note.
    """
    binary = binary or find_llama_server()
    if binary is None:
        raise LlamaServerError(f"llama-server not found; set ${BINARY_ENV} or run .ci/build-llama-server")
    model_path = Path(model_path)
    with tempfile.TemporaryDirectory(prefix="apsd-llama-server-") as own_dir:
        logs = Path(log_dir) if log_dir is not None else Path(own_dir)
        process: trio.Process | None = None
        try:
            for _attempt in range(_START_ATTEMPTS):
                port = _free_loopback_port()
                log_path = logs / f"llama-server-{port}.log"
                command = [
                    binary, "-m", str(model_path), "--alias", alias,
                    "--host", "127.0.0.1", "--port", str(port),
                    "-c", str(ctx), "-np", str(parallel), "-t", "1", "-tb", "1", "--metrics",
                    *extra_args,
                ]
                with open(log_path, "wb") as log:
                    process = await trio.lowlevel.open_process(
                        command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
                    )
                url = f"http://127.0.0.1:{port}"
                if await _wait_healthy(process, url, log_path, startup_timeout):
                    break
                await stop_process(process, stop_timeout)
                process = None
            else:
                raise LlamaServerError(
                    f"llama-server could not bind a port in {_START_ATTEMPTS} attempts\n{_tail(log_path, 40)}"
                )
            server = LlamaServer(url=url, port=port, process=process, alias=alias,
                                 model_path=model_path, log_path=log_path)
            try:
                yield server
            except BaseException as exc:
                if not isinstance(exc, (trio.Cancelled, KeyboardInterrupt, SystemExit, GeneratorExit)):
                    exc.add_note(f"llama-server log ({log_path.name}), last lines:\n{server.log_tail()}")
                raise
        finally:
            if process is not None:
                await stop_process(process, stop_timeout)


async def _wait_healthy(process: trio.Process, url: str, log_path: Path, timeout: float) -> bool:
    """True once /health answers 200; False if the process exited because its port was taken."""
    polls = int(timeout / _POLL_INTERVAL) + 1
    last = "no answer yet"
    with trio.move_on_after(timeout):
        async with httpx.AsyncClient(base_url=url, timeout=2.0) as client:
            for _ in range(polls):
                if process.poll() is not None:
                    tail = _tail(log_path, 40)
                    if "couldn't bind" in tail:
                        return False
                    raise LlamaServerError(
                        f"llama-server exited with {process.returncode} before /health answered 200"
                        f"\ncommand: {' '.join(map(str, process.args))}\n{tail}"
                    )
                try:
                    response = await client.get("/health")
                except httpx.TransportError as exc:
                    last = repr(exc)
                else:
                    if response.status_code == 200:
                        return True
                    last = f"{response.status_code} {response.text[:200]}"  # 503 while loading
                await trio.sleep(_POLL_INTERVAL)
    raise LlamaServerError(
        f"llama-server /health did not answer 200 within {timeout} s (last: {last})\n{_tail(log_path, 40)}"
    )


async def stop_process(process: trio.Process, timeout: float = 10.0) -> None:
    """SIGTERM by PID, SIGKILL after ``timeout`` s, then reap. Shielded: runs even when cancelled."""
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            # Popen.send_signal: os.kill(pid) unless already reaped, so a recycled PID is never hit.
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(timeout):
                await process.wait()
        if process.returncode is None:
            process.send_signal(signal.SIGKILL)
            with trio.move_on_after(timeout):
                await process.wait()


# Fixtures: import them explicitly into the test module that uses them.


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model (~570 KB, thousands of tokens/s), written once per session."""
    return write_tiny_model(tmp_path_factory.mktemp("llama-model") / "tiny.gguf")


@pytest.fixture(scope="session")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:data:`SLOW_MODEL` (hundreds of tokens/s), for requests that must overlap in time."""
    return write_tiny_model(tmp_path_factory.mktemp("llama-model") / "slow.gguf", **SLOW_MODEL)


@pytest.fixture
def llama_server_binary() -> str:
    """:func:`require_llama_server` as a fixture: the binary's path, or skip (fail in CI).

    A sync fixture on purpose: a skip raised inside a Trio test or async fixture reaches pytest
    through pytest-trio without its reason.
    """
    return require_llama_server()


@pytest.fixture
async def llama_server(llama_server_binary: str, tiny_model: Path, tmp_path: Path) -> AsyncIterator[LlamaServer]:
    """A llama-server with the tiny model as ``tiny``, 4 slots; its log in the test's tmp_path."""
    async with open_llama_server(tiny_model, binary=llama_server_binary, log_dir=tmp_path) as server:
        yield server


@pytest.fixture
async def slow_llama_server(llama_server_binary: str, slow_model: Path,
                            tmp_path: Path) -> AsyncIterator[LlamaServer]:
    """A llama-server with :data:`SLOW_MODEL` as ``slow``, 4 slots."""
    async with open_llama_server(slow_model, alias="slow", binary=llama_server_binary,
                                 log_dir=tmp_path) as server:
        yield server
